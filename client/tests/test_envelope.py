"""readie-style calls without a sandbox: payloads run through the executor's own call code, envelopes decoded."""

from __future__ import annotations

import os
import pickle
import sys
import types

import cloudpickle
import pytest
import readie
from readie import RemoteResult
from readie._envelope import (
    SANDBOX_PYTHON,
    by_value_module,
    call_payload,
    check_python,
    decode_envelope,
)
from readie_executor import run_call


def greet(name, punctuation="!"):
    print(f"greeting {name}")
    return f"hello {name}{punctuation}"


def fail(kind):
    print("about to fail")
    raise {"value": ValueError, "key": KeyError}[kind]("it went wrong")


def through_executor(func, *args, **kwargs):
    """A call as the sandbox would answer it: the executor's run_call on our payload."""
    return decode_envelope(run_call(call_payload(func, args, kwargs)))


def test_a_value_and_its_output_come_back():
    assert through_executor(greet, "ada", punctuation="?") == RemoteResult("hello ada?", ("greeting ada\n",))
    assert through_executor(greet, "ada").text == "greeting ada\n"


def test_an_exception_comes_back_as_remote_error_with_the_remote_traceback():
    with pytest.raises(readie.RemoteError) as raised:
        through_executor(fail, "value")
    error = raised.value
    assert (error.exc_type, error.message, error.output) == ("ValueError", "it went wrong", ("about to fail\n",))
    assert "in fail" in error.traceback and error.traceback.rstrip().endswith("ValueError: it went wrong")
    assert str(error).startswith("ValueError: it went wrong\n\nRemote traceback (from the sandbox):\nTraceback")
    assert isinstance(error, readie.ReadieError)


def test_a_value_that_cannot_be_pickled_there_is_a_remote_pickling_error():
    with pytest.raises(readie.RemoteError) as raised:
        through_executor(lambda: (x for x in ()))
    assert raised.value.exc_type == "PicklingError"
    assert "the return value (generator) cannot be pickled" in raised.value.message


def test_a_value_that_cannot_be_loaded_here_is_an_envelope_error(monkeypatch):
    module = types.ModuleType("readie_only_in_the_sandbox")
    module.Thing = type("Thing", (), {"__module__": module.__name__})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    envelope = pickle.dumps({"ok": True, "value": module.Thing(), "output": []})
    monkeypatch.delitem(sys.modules, module.__name__)
    with pytest.raises(readie.EnvelopeError, match="cannot be loaded here: ModuleNotFoundError"):
        decode_envelope(envelope)


@pytest.mark.parametrize(
    ("envelope", "message"),
    [
        (b"not a pickle", "cannot be loaded here"),
        (pickle.dumps(["ok"]), "not an envelope"),
        (pickle.dumps({"ok": 1, "value": 2}), "not an envelope"),
        (pickle.dumps({"ok": True}), "holds no value"),
        (pickle.dumps({"ok": True, "value": 1, "output": "text"}), "output is not a list of text"),
        (pickle.dumps({"ok": False, "exc_type": "E", "message": None, "traceback": ""}), "no text message"),
    ],
)
def test_malformed_envelopes(envelope, message):
    with pytest.raises(readie.EnvelopeError, match=message):
        decode_envelope(envelope)


def test_the_callers_own_module_goes_by_value(monkeypatch):
    assert by_value_module(greet) is sys.modules[greet.__module__]
    assert by_value_module(os.path.join) is None  # the standard library: the sandbox has it
    assert by_value_module(cloudpickle.dumps) is None  # an installed package: the sandbox may have its own
    payload = call_payload(greet, ("bob",), {})
    # Loadable where this module does not exist, as in the sandbox.
    monkeypatch.delitem(sys.modules, greet.__module__)
    call = pickle.loads(payload)
    assert call["func"]("bob") == "hello bob!"
    assert greet.__module__ not in cloudpickle.list_registry_pickle_by_value()


def test_an_unpicklable_call_is_refused_before_sending():
    import threading

    with pytest.raises(readie.RequestError, match="cannot pickle the call to greet") as refused:
        call_payload(greet, (threading.Lock(),), {})
    assert refused.value.field == "payload"


def test_the_python_version_must_be_the_sandboxes(monkeypatch):
    assert SANDBOX_PYTHON == (3, 11)
    check_python((3, 11, 9))
    with pytest.raises(readie.VersionMismatch) as refused:
        check_python((3, 12, 1))
    message = str(refused.value)
    assert "the sandboxes run Python 3.11" in message and "this is Python 3.12" in message
    assert "cloudpickle only carries functions between equal minor versions" in message

    # A call checks before it pickles or connects: nothing listens on port 1.
    monkeypatch.setattr("readie._envelope.SANDBOX_PYTHON", (3, 99))
    with readie.Client("127.0.0.1:1") as client, pytest.raises(readie.VersionMismatch, match="Python 3.99"):
        client.call(greet, "ada")


def test_remote_functions_keep_the_original_and_pickle_without_their_connection(monkeypatch):
    monkeypatch.delenv("READIE_ROUTER", raising=False)
    shout = readie.remote(greet)
    assert shout.local("x") == "hello x!" and shout.__name__ == "greet"
    copy = cloudpickle.loads(cloudpickle.dumps(shout))
    assert copy.local("y") == "hello y!"
    with pytest.raises(ValueError, match="set READIE_ROUTER"):
        shout("z")
    configured = readie.remote(checkpoint="pandas", router="127.0.0.1:1", timeout=5)(greet)
    assert (configured.client().checkpoint, configured.client().timeout) == ("pandas", 5.0)
