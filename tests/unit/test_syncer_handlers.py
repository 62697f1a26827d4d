"""Every handler of the syncer service is total: metadata of any wrong type or size, from a
learner holding the secret, is refused and counted, never an exception out of the loop."""

from __future__ import annotations

import io
import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.syncer.answers import Answers
from ddiloco.runtime.processes.syncer.service import SyncerService
from ddiloco.runtime.processes.transport.events import EVENT_PREFIX, Events
from ddiloco.runtime.run import RunSetup

FIELDS = [
    "inc",
    "step",
    "versions",
    "peer",
    "tokens",
    "secs",
    "rebased",
    "total",
    "rebases",
    "learner",
    "incarnation",
    "seq",
    "fragment",
    "round_id",
    "base_version",
    "local_step",
    "c_steps",
    "c_tokens",
    "key",
    "why",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5)
    ),
    max_leaves=12,
)
METAS = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), VALUES, max_size=10)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    config = load_config(
        None,
        [
            "model='gpt-tiny'",
            "train.learners=2",
            "sync.fragments=2",
            "sync.sync_every=2",
            "data.eval_batches=1",
        ],
    )
    store = tmp_path_factory.mktemp("store")
    events = Events(time.time(), io.StringIO())
    svc = SyncerService(
        RunSetup(config), f"127.0.0.1:{free_port('127.0.0.1')}", "r", b"s" * 32, store, events
    )
    yield svc
    svc.conn.close()


# every message kind the service has a handler for (on_<kind>): a new one is fuzzed here too
KINDS = sorted(
    name.removeprefix("on_")
    for cls in (SyncerService, Answers)
    for name in dir(cls)
    if name.startswith("on_")
)


def test_the_handler_table_is_every_on_method(service):
    assert sorted(service.handlers) == KINDS and len(KINDS) >= 6


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from([*KINDS, "what"]),  # every kind a handler takes, and an unknown one
    meta=METAS,
    payload=st.binary(max_size=64),
    m=st.integers(0, 1),
)
def test_any_metadata_is_refused_or_handled_never_raised(service, kind, meta, payload, m):
    service.conn.sessions[m] = meta.get("inc") if isinstance(meta.get("inc"), int) else 5
    before = sum(service.counts.values())
    service.dispatch(m, kind, meta, memoryview(payload))  # must not raise
    assert math.isfinite(service.tokens) and service.tokens >= 0
    assert all(v >= 0 for v in service.syncer.versions)
    assert service.counts.get("handler_error", 0) == 0  # refused by the checks, not a bug
    if kind == "what":
        assert sum(service.counts.values()) == before + 1  # refused_kind


def test_each_malformed_shape_is_counted_as_refused_metadata(service):
    service.conn.sessions[0] = 5
    shapes = [
        ("hello", {"inc": "abc", "step": 0, "versions": [0, 0]}),
        ("hello", {"inc": 5, "step": 0, "versions": []}),
        ("hello", {"inc": 5, "step": math.inf, "versions": [0, 0]}),
        ("hello", {"inc": 5, "step": 0, "versions": {"a": 1}}),
        ("progress", {"inc": 5, "step": 1, "tokens": "x", "secs": 0.1}),
        ("progress", {"inc": 5, "step": math.nan, "tokens": 1, "secs": 0.1}),
        ("answer", {"c_tokens": "x"}),
    ]
    before = service.counts["refused_meta"]
    for kind, meta in shapes:
        service.dispatch(0, kind, meta, memoryview(b""))
    assert service.counts["refused_meta"] - before == len(shapes)


def test_peers_are_the_learners_that_trained_the_furthest_first(service, monkeypatch):
    # three learners started together: one trained, two registered at step 0 and are about
    # to copy a peer; each must try the one that trained first, the other copier last (it is
    # copying too and does not answer: a 10-s timeout each, seen by hand)
    sent: list[tuple[int, str, dict]] = []
    monkeypatch.setattr(service, "send", lambda m, msg, **_: sent.append((m, msg.KIND, msg.meta())))
    for m, step in {0: 0, 1: 0, 2: 7, 3: 12}.items():
        service.syncer.join(m, step)
    for m in range(4):
        service.roster.hello(m, 5, f"127.0.0.1:{4000 + m}")
    service.on_peers(0, {}, memoryview(b""))
    service.on_peers(3, {}, memoryview(b""))
    assert sent[0][:2] == (0, "peers") and sent[0][2]["peers"]["3"] == "127.0.0.1:4003"
    assert list(sent[0][2]["peers"]) == ["3", "2", "1"]  # the order the learner tries them in
    assert list(sent[1][2]["peers"]) == ["2", "0", "1"]  # (ties: by id)


def test_a_goodbye_says_why_in_the_left_event(service):
    # the typed Bye of docs/extending.md's recipe: its reason reaches the syncer's events
    service.conn.sessions[1] = 9
    service.dispatch(1, "hello", {"inc": 9, "step": 0, "versions": [0, 0]}, memoryview(b""))
    service.dispatch(1, "bye", {"why": "SIGTERM"}, memoryview(b""))
    out = service.events.stream.getvalue().splitlines()
    lines = [json.loads(line.removeprefix(EVENT_PREFIX)) for line in out]
    assert {"kind": "left", "learner": 1, "why": "SIGTERM"}.items() <= lines[-1].items()
    assert 1 not in service.syncer.live
