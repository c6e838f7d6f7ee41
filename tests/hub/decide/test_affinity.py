"""The affinity decision (appliance/hub/decide/affinity.py), called without sockets."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance import config
from appliance.hub.decide.affinity import (
    BALANCE_SLACK,
    PREFIX,
    SESSION,
    SPREAD,
    Affinity,
    Candidate,
    PrefixIndex,
    Route,
    first_within,
    load_limit,
    rendezvous,
)
from appliance.hub.translate.prompt import MAX_BLOCKS, chain_of, render, session_of


def route_key(obj, headers, block):  # type: ignore[no-untyped-def]
    """A request's key as an affinity of `block`-byte blocks makes it."""
    return Affinity(block=block).key(obj, headers)

BLOCK = 256


def cands(*loads: int, full: tuple[str, ...] = ()) -> list[Candidate]:
    return [Candidate(f"n{i}", load, f"n{i}" in full) for i, load in enumerate(loads)]


# --- session sources ---------------------------------------------------------------------


def test_session_sources_first_found_wins() -> None:
    body = {"prompt_cache_key": "pck", "metadata": {"user_id": "uid"}}
    headers = [(b"conversation_id", b"conv"), (b"session_id", b"sid"),
               (b"x-claude-code-session-id", b"cc"), (b"x-session-id", b"xs")]
    order = [session_of(body, headers)]
    body.pop("prompt_cache_key")
    for _ in range(4):
        order.append(session_of(body, headers))
        headers.pop()  # the last-listed header is the highest ranked one
    order.append(session_of(body, headers))
    body.pop("metadata")
    assert session_of(body, headers) is None
    assert None not in order and len(set(order)) == 6  # each source gives its own key
    # and each is the one its source alone gives
    assert order[0] == session_of({"prompt_cache_key": "pck"}, [])
    assert order[1] == session_of({}, [(b"x-session-id", b"xs")])
    assert order[2] == session_of({}, [(b"x-claude-code-session-id", b"cc")])
    assert order[3] == session_of({}, [(b"session_id", b"sid")])
    assert order[4] == session_of({}, [(b"conversation_id", b"conv")])
    assert order[5] == session_of({"metadata": {"user_id": "uid"}}, [])


def test_empty_or_odd_session_values_are_ignored() -> None:
    assert session_of({"prompt_cache_key": "", "metadata": "x"}, [(b"x-session-id", b"")]) is None
    assert session_of({"prompt_cache_key": 5, "metadata": {"user_id": 7}}, []) is None


def test_a_key_of_any_size_is_hashed_never_kept() -> None:
    huge = "s" * 5_000_000
    r = route_key({"prompt_cache_key": huge, "messages": [{"role": "user", "content": "hi"}]},
                  [], BLOCK)
    assert r.session is not None and len(r.session) == 16 and r.chain == []
    hr = route_key({}, [(b"x-session-id", b"\xff\x00" * 100_000)], BLOCK)
    assert hr.session is not None and len(hr.session) == 16
    # surrogates and control characters hash too
    assert session_of({"prompt_cache_key": "\ud800\x00"}, []) is not None


# --- the prefix chain --------------------------------------------------------------------

msg = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                             "content": st.text(min_size=0, max_size=600)})


@settings(max_examples=200, deadline=None)
@given(st.lists(msg, min_size=1, max_size=8), msg, st.one_of(st.none(), st.text(max_size=300)))
def test_a_conversation_extended_by_a_turn_keeps_its_earlier_blocks(msgs, turn, system) -> None:
    body = {"messages": msgs, **({"system": system} if system else {})}
    longer = {**body, "messages": [*msgs, turn]}
    short_bytes = render(body)
    assert render(longer).startswith(short_bytes)
    full = min(len(short_bytes) // BLOCK, MAX_BLOCKS)
    assert chain_of(render(longer), BLOCK)[:full] == chain_of(short_bytes, BLOCK)[:full]


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=BLOCK, max_size=BLOCK * 12), st.data())
def test_an_edit_before_block_k_changes_every_block_from_k(data, draw) -> None:
    pos = draw.draw(st.integers(0, len(data) - 1))
    new = draw.draw(st.integers(0, 255).filter(lambda b: b != data[pos]))
    edited = data[:pos] + bytes([new]) + data[pos + 1:]
    a, b = chain_of(data, BLOCK), chain_of(edited, BLOCK)
    k = pos // BLOCK
    assert a[:k] == b[:k]
    if k < len(a):
        assert all(x != y for x, y in zip(a[k:], b[k:], strict=True))


def test_render_order_tools_system_conversation() -> None:
    r = render({"messages": [{"role": "user", "content": "m"}], "system": "s",
                "tools": [{"name": "t"}]})
    assert r.index(b"\x1eT") < r.index(b"\x1eS") < r.index(b"\x1eM")
    assert render({"prompt": "p", "system": "s"}).endswith(b"\x1eMp")


def test_the_chain_is_bounded() -> None:
    assert len(chain_of(b"x" * (BLOCK * (MAX_BLOCKS + 50)), BLOCK)) == MAX_BLOCKS
    assert chain_of(b"short", BLOCK) == [] and chain_of(b"", BLOCK) == []
    a = Affinity()
    r = route_key({"prompt": "short"}, [], BLOCK)
    assert a.choose("m", r, cands(0, 0)) is None and r.reason == SPREAD  # spread by load


# --- rendezvous and the load bound -------------------------------------------------------


def test_rendezvous_removing_a_node_moves_only_its_keys() -> None:
    names = [f"gpu-{i}" for i in range(7)]
    keys = [f"session-{i}".encode() for i in range(3000)]
    before = {k: rendezvous(k, names)[0] for k in keys}
    gone = "gpu-3"
    after = {k: rendezvous(k, [n for n in names if n != gone])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] == gone)
    # the spread is even enough: each node is first for 1/7 of the keys, +-30%
    counts = collections.Counter(before.values())
    assert all(abs(c - 3000 / 7) < 0.3 * 3000 / 7 for c in counts.values())


def test_a_hub_restart_keeps_sessions_on_their_nodes() -> None:
    """Rendezvous needs no state: a fresh Affinity (a restarted hub, or a second hub)
    sends each session where the first one did."""
    nodes = cands(0, 0, 0)
    first, restarted = Affinity(), Affinity()
    for i in range(200):
        r1 = Route(session=session_of({"prompt_cache_key": f"s{i}"}, []))
        r2 = Route(session=session_of({"prompt_cache_key": f"s{i}"}, []))
        assert first.choose("m", r1, nodes) == restarted.choose("m", r2, nodes)
        assert r1.reason == SESSION


def test_the_load_bound_under_a_hot_session() -> None:
    a = Affinity(factor=1.25)
    nodes = {n: 0 for n in ("a", "b", "c")}
    placed: collections.Counter[str] = collections.Counter()
    for _ in range(60):  # one session, 60 requests at once
        r = Route(session=b"hot-session-key0")
        got = a.choose("m", r, [Candidate(n, load) for n, load in nodes.items()])
        assert got is not None
        nodes[got] += 1
        placed[got] += 1
        mean = sum(nodes.values()) / 3
        assert max(nodes.values()) <= max(1.25 * mean + 1, mean + BALANCE_SLACK)
    assert len(placed) == 3 and a.stats("m").moved > 0
    # with room, the session stays on its own node
    home = rendezvous(b"hot-session-key0", ["a", "b", "c"])[0]
    assert a.choose("m", Route(session=b"hot-session-key0"),
                    [Candidate(n, 4) for n in "abc"]) == home


def test_the_bound_is_the_factor_at_scale_and_a_slack_at_a_handful() -> None:
    assert load_limit(cands(0, 0, 0), 1.25) == BALANCE_SLACK
    assert load_limit(cands(100, 100, 100), 1.25) == 126  # ceil(1.25 x 301 / 3)
    order = ["n0", "n1", "n2"]
    assert first_within(order, cands(4, 0, 0), 1.25) == ("n0", False)  # 5 <= 1 + 4
    assert first_within(order, cands(5, 0, 0), 1.25) == ("n1", True)  # 6 > 1 + 4
    assert first_within(order, cands(150, 100, 100), 1.25) == ("n1", True)  # 151 > 147


def test_a_full_node_is_passed_over_and_none_within_means_spread() -> None:
    order = ["n0", "n1", "n2"]
    assert first_within(order, cands(0, 0, 0, full=("n0",)), 1.25) == ("n1", True)
    assert first_within(order, cands(0, 0, 0, full=("n0", "n1", "n2")), 1.25) == (None, True)
    a = Affinity()
    r = Route(session=b"k" * 16)
    assert a.choose("m", r, cands(0, 0, full=("n0", "n1"))) is None
    assert r.reason == SPREAD


# --- the prefix index --------------------------------------------------------------------


def conversation(turns: int, ctx: str) -> dict:
    msgs = [{"role": "system", "content": ctx}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"question {t} " * 20},
                 {"role": "assistant", "content": f"answer {t} " * 30}]
    msgs.append({"role": "user", "content": "next?"})
    return {"messages": msgs}


def test_turn_two_follows_turn_one_even_off_its_rendezvous_node() -> None:
    a = Affinity()
    nodes = cands(0, 0, 0)
    r1 = route_key(conversation(0, "context A " * 200), [], BLOCK)
    first = a.choose("m", r1, nodes)
    assert first is not None and r1.reason == SPREAD
    other = next(c.name for c in nodes if c.name != first)
    a.served("m", r1, other)  # the bound sent it elsewhere: the index follows the node
    r2 = route_key(conversation(1, "context A " * 200), [], BLOCK)
    assert a.choose("m", r2, nodes) == other and r2.reason == PREFIX and r2.matched > 0


def test_engine_reported_miss_forgets_older_entries_of_that_node() -> None:
    a = Affinity()
    nodes = cands(0, 0, 0)
    old = route_key(conversation(2, "old " * 300), [], BLOCK)
    a.choose("m", old, nodes)
    a.served("m", old, "n0")
    new = route_key(conversation(2, "new " * 300), [], BLOCK)
    a.choose("m", new, nodes)
    a.served("m", new, "n0")
    nxt = route_key(conversation(3, "new " * 300), [], BLOCK)
    assert a.choose("m", nxt, nodes) == "n0" and nxt.reason == PREFIX
    nxt.prompt_tokens, nxt.cached_tokens = 900, 0  # the engine had evicted it
    a.served("m", nxt, "n0")
    s = a.stats("m")
    assert (s.predicted, s.confirmed) == (1, 0)
    again = route_key(conversation(3, "old " * 300), [], BLOCK)
    a.choose("m", again, nodes)
    assert again.reason == SPREAD  # written before the miss: forgotten
    latest = route_key(conversation(4, "new " * 300), [], BLOCK)
    a.choose("m", latest, nodes)
    assert latest.reason == PREFIX  # written by the request that showed the miss: kept
    latest.prompt_tokens, latest.cached_tokens = 1000, 800
    a.served("m", latest, latest.node)
    s = a.stats("m")
    assert (s.predicted, s.confirmed) == (2, 1)
    assert s.as_dict()["cache_hit_ratio"] == round(800 / 1900, 4)


def test_a_node_not_among_the_candidates_is_no_match() -> None:
    a = Affinity()
    r = route_key(conversation(1, "ctx " * 300), [], BLOCK)
    a.choose("m", r, cands(0, 0, 0))
    a.served("m", r, "gone")
    r2 = route_key(conversation(2, "ctx " * 300), [], BLOCK)
    assert a.choose("m", r2, cands(0, 0, 0)) in ("n0", "n1", "n2") and r2.reason == SPREAD


def test_the_index_stays_within_its_bound_under_100k_distinct_prompts() -> None:
    a = Affinity(entries=5_000)
    nodes = cands(0, 0, 0)
    for i in range(100_000):
        r = route_key({"prompt": f"unique prompt {i} " + "x" * 600}, [], BLOCK)
        if i % 100 == 0:
            a.choose("m", r, nodes)
        a.served("m", r, f"n{i % 3}")
        if i % 1000 == 0:
            assert len(a.index["m"]) <= 5_000
    assert len(a.index["m"]) == 5_000
    assert set(a.models) == {"m"}  # counts per model: nothing grows per prompt


def test_lru_keeps_what_is_used() -> None:
    ix = PrefixIndex(3)
    ix.record([1], "a")
    ix.record([2], "a")
    ix.record([3], "a")
    assert ix.longest([1], {"a"})[0] == 1  # 1 is fresh now
    ix.record([4], "a")
    assert 2 not in ix.entries and 1 in ix.entries


def test_off_keys_nothing_but_still_counts_the_engines_cache() -> None:
    a = Affinity(enabled=False)
    r = a.key({"prompt_cache_key": "x", "prompt": "p" * 5000}, [])
    assert r.session is None and r.chain == []
    r.prompt_tokens, r.cached_tokens = 1000, 250
    a.served("m", r, "n0")
    assert a.status("m")["cache_hit_ratio"] == 0.25 and not a.index


def test_configure_new_block_size_clears_the_index() -> None:
    a = Affinity()
    r = route_key(conversation(1, "ctx " * 300), [], BLOCK)
    a.choose("m", r, cands(0, 0))
    a.served("m", r, "n0")
    a.configure(True, 1.25, 10, 512)
    assert not a.index


def test_settings_are_validated() -> None:
    c = config.load({})
    assert (c.router.affinity, c.router.affinity_load_factor, c.router.affinity_index_entries,
            c.router.affinity_block_chars) == ("on", 1.25, 100_000, 256)
    assert (c.sim.cache_tokens, c.sim.prefill_tokens_per_second) == (32768, 4000.0)
    for bad in ({"Router__Affinity": "maybe"}, {"Router__AffinityLoadFactor": "0.9"},
                {"Router__AffinityIndexEntries": "0"}, {"Router__AffinityBlockChars": "8"},
                {"Router__AffinityLoadFactor": "inf"}, {"Sim__CacheTokens": "-1"},
                {"Sim__PrefillTokensPerSecond": "-1"}):
        with pytest.raises(config.ConfigError, match=next(iter(bad))):
            config.load(bad)
