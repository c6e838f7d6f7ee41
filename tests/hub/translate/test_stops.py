"""The hub's own stop-sequence matching (translate/stops.py): text goes out as soon as no
sequence can start in it, a sequence split over pieces is found, the earliest wins, and
nothing goes out after it."""

from __future__ import annotations

from appliance.hub.translate.stops import StopWatch


def test_text_goes_out_until_a_sequence_split_over_pieces() -> None:
    w = StopWatch(["END"])
    assert w.feed("hello E") == "hello "  # "E" may start END: held
    assert w.feed("x") == "Ex"  # it did not
    assert w.feed("done EN") == "done "
    assert w.feed("D and more") == "" and w.matched == "END"
    assert w.feed("later") == "" and w.flush() == ""


def test_the_earliest_sequence_wins_and_a_flush_gives_back_what_was_held() -> None:
    w = StopWatch(["stop", "op"])
    assert w.feed("a sto") == "a " and w.matched is None
    assert w.feed("p") == "" and w.matched == "stop"
    w2 = StopWatch(["###"])
    assert w2.feed("x ##") == "x " and w2.flush() == "##"
