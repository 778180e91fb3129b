"""A stateful CodeAct agent on readie: the model writes Python that calls your functions directly.

    uv run python examples/agent_tool.py

``readie.tool(pool=..., session=True, functions={...})`` is what you hand a
model: one tool, ``run_python``, whose description (``tool.description``)
says what the sandbox allows and lists the host functions with their
signatures and docstrings. Every call runs as the next step of one session
(one gVisor sandbox whose variables survive between calls, like notebook
cells); when the code calls ``search_orders`` or ``notify`` from
``readie_host``, the call runs here, in this process, and its value goes
back into the sandbox. The code itself can read the project's ``data/`` and
nothing else, has no network and cannot start processes.

The model here is a fake (:class:`ScriptedModel`: canned replies, one per
turn) so the example runs offline and shows the loop, not a model: define a
variable, use it in the next call, make a mistake and read the error, fix
it, answer. Swap in a real model's API by giving it ``tool.spec()`` and the
conversation. It needs the checkpoints from ``make capture`` (found through
$READIE_CHECKPOINTS, else build/checkpoints of this repository).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import readie

REPO = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------- the host's functions

# What the application owns and the sandbox cannot see: a database, an outbox.
ORDERS = {
    "tea": [{"order": 1, "amount": 3}, {"order": 3, "amount": 4}],
    "cake": [{"order": 2, "amount": 5}],
}
OUTBOX: list[str] = []


def search_orders(product: str, limit: int = 10) -> list[dict[str, int]]:
    """Orders of one product from the shop's database, oldest first.

    Each order is {"order": id, "amount": units}. Unknown products have none.
    """
    return ORDERS.get(product, [])[:limit]


def notify(message: str) -> str:
    """Send ``message`` to the shop owner; returns a receipt id."""
    OUTBOX.append(message)
    return f"msg-{len(OUTBOX)}"


FUNCTIONS = {"search_orders": search_orders, "notify": notify}

# --------------------------------------------------------------------------- the model (a fake)


@dataclass
class Turn:
    """What the model says: code to run with the tool, or its final answer."""

    code: str | None = None
    answer: str | None = None


@dataclass
class ScriptedModel:
    """Plays back canned turns; a real model would read ``messages`` and ``tools``."""

    turns: list[Turn]
    seen: list[list[dict[str, str]]] = field(default_factory=list)

    def respond(self, messages: list[dict[str, str]], tools: list[dict[str, object]]) -> Turn:
        self.seen.append(list(messages))
        return self.turns[len(self.seen) - 1]


SCRIPT = [
    # Turn 1: call a host function and keep the result in a variable.
    Turn(code="from readie_host import search_orders, notify\ntea = search_orders('tea')\nprint(len(tea), 'tea orders')"),
    # Turn 2: the variable is still there (a session); a typo fails like a notebook cell.
    Turn(code="total = sum(o['amount'] for o in tee)\nprint(total)"),
    # Turn 3: the model read the NameError and fixes it; then it notifies the owner through the host.
    Turn(code="total = sum(o['amount'] for o in tea)\nprint(total, notify(f'{total} units of tea ordered'))"),
    Turn(answer="Tea: 2 orders, 7 units in total; I told the shop owner (receipt msg-1)."),
]

# --------------------------------------------------------------------------- the agent loop


def agent(model: ScriptedModel, tool: readie.Tool, task: str, max_turns: int = 10) -> str:
    """The CodeAct loop: the model writes code, the tool runs it, the model reads what it printed."""
    messages = [{"role": "system", "content": tool.description}, {"role": "user", "content": task}]
    for _ in range(max_turns):
        turn = model.respond(messages, tools=[tool.spec()])
        if turn.answer is not None:
            return turn.answer
        assert turn.code is not None
        messages.append({"role": "assistant", "content": turn.code})
        observation = tool(turn.code)  # what the code printed, or its error, as the model reads it
        messages.append({"role": "tool", "content": observation})
        print(f">>> {turn.code}\n{observation}\n")
    return "(gave up)"


@contextmanager
def demo_project() -> Iterator[Path]:
    path = Path(os.environ.get("AGENT_PROJECT") or tempfile.mkdtemp(prefix="agent-project-"))
    (path / "data").mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if not os.environ.get("AGENT_PROJECT"):
            shutil.rmtree(path, ignore_errors=True)


def checkpoints() -> Path | None:
    if os.environ.get("READIE_CHECKPOINTS"):
        return None  # readie pool reads it itself
    built = REPO / "build" / "checkpoints"
    return built if built.is_dir() else None


def main() -> None:
    with demo_project() as project, readie.Pool(workers=2, cwd=project, checkpoints=checkpoints()) as pool:
        with readie.tool(
            pool=pool, session=True, functions=FUNCTIONS, allow_read=["data"], timeout="10s", memory="512m"
        ) as run_python:
            print(f"--- the tool's description, as the model reads it:\n{run_python.description}\n")
            answer = agent(ScriptedModel(SCRIPT), run_python, "How much tea was ordered? Tell the owner.")
    print(f"--- answer: {answer}")
    print(f"--- the owner's outbox (filled by the sandbox's calls, in this process): {OUTBOX}")


if __name__ == "__main__":
    main()
