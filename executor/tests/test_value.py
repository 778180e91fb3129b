"""The last expression's value, shown (jobs/_value.py): the bounds and what the job's own objects
may do to them. Pure: the display methods are called here, as the runner calls them in the sandbox."""

from __future__ import annotations

from readie_executor.jobs import bounds
from readie_executor.jobs._value import compile_cell, show_value


def test_a_cell_splits_off_its_last_bare_expression_only():
    body, last = compile_cell("x = 1\nx + 1", "<cell>")
    namespace: dict[str, object] = {}
    exec(body, namespace)
    assert last is not None and eval(last, namespace) == 2
    assert compile_cell("x = 1", "<cell>")[1] is None


def test_a_str_subclass_from_repr_or_a_display_method_comes_out_an_exact_str():
    class Sly(str):
        def __getitem__(self, item):  # what fit_text would call, unguarded, after the job
            raise AssertionError("the job's code ran outside its limits")

        def encode(self, *args, **kwargs):
            raise AssertionError("the job's code ran outside its limits")

    class Thing:
        def __repr__(self):
            return Sly("thing")

        def _repr_html_(self):
            return Sly("<b>thing</b>")

    shown = show_value(Thing(), 1024)
    assert shown is not None and shown["text"] == "thing" and type(shown["text"]) is str
    assert shown["data"] == {"text/html": "<b>thing</b>"} and type(shown["data"]["text/html"]) is str


def test_display_data_is_bounded_by_max_output_too_and_a_picture_too_large_is_never_encoded():
    class Picture:
        def __repr__(self):
            return "Picture()"

        def _repr_png_(self):
            return b"\x89PNG" + b"\0" * 3000

        def _repr_html_(self):
            return "<img/>"

    small = show_value(Picture(), 100)
    assert small is not None and small["data"] == {"text/html": "<img/>"} and small["omitted"] == ["image/png"]
    assert show_value(Picture(), 0)["data"] == {}
    roomy = show_value(Picture(), bounds.MAX_OUTPUT_LIMIT)
    assert set(roomy["data"]) == {"text/html", "image/png"}


def test_none_shows_nothing_and_a_failing_method_offers_nothing():
    class Broken:
        def __repr__(self):
            return "Broken()"

        def _repr_html_(self):
            raise ValueError("no")

    assert show_value(None, 100) is None
    assert show_value(Broken(), 100) == {"text": "Broken()", "truncated": False, "data": {}, "omitted": []}
