"""Identity of the coding-agent clients from the headers they were recorded sending
(tests/client_headers.py): each sub-agent its own session, a child of the agent that spawned it,
in its conversation's tree, with the default settings. No Node needed."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict

from sidecar.config import IdentityConfig
from sidecar.context import TurnOutcome
from sidecar.errors import ConfigError
from sidecar.identity import Identity, IdentityReader, agent_session
from sidecar.lineage import SessionTree
from sidecar.modes.ids import fit_id
from tests.client_headers import CLAUDE_CODE, CODEX, ID_HEADERS, OPENCODE, Headers
from tests.conftest import _with_file


def read(headers: Headers | dict[str, str], **cfg: Any) -> Identity:
    return IdentityReader(IdentityConfig(**cfg)).read(CIMultiDict(headers))


def lineage(requests: list[Headers], **cfg: Any) -> list[tuple[str | None, str | None, str | None]]:
    out = []
    for headers in requests:
        ident = read(headers, **cfg)
        out.append((ident.session, ident.parent, ident.root))
    return out


def header(headers: Headers, name: str) -> str:
    return next(v for k, v in headers if k.lower() == name)


def shape(tree: dict[str, Any]) -> dict[str, Any]:
    """A tree view as {session: {child: {...}}}."""
    return {tree["session"]: {k: v for c in tree["children"] for k, v in shape(c).items()}}


def tree_of(requests: list[Headers], **cfg: Any) -> dict[str, Any]:
    """The lineage tree the requests build, one turn each, in the order they were sent."""
    tree = SessionTree(idle_ttl=60, max_live=100, tombstone_max=10, tombstone_ttl=60)
    reader = IdentityReader(IdentityConfig(**cfg))
    roots = set()
    for headers in requests:
        ident = reader.read(CIMultiDict(headers))
        assert ident.session is not None
        turn, _ = tree.begin(ident.session, ident.parent, ident.root, ident.final, "default")
        roots.add(turn.ctx.root)
        tree.finish(turn, TurnOutcome.COMPLETED)
    (root,) = roots
    view = tree.tree(root)
    assert view is not None
    return shape(view)


def test_claude_code_sub_agents_are_children_scoped_by_their_conversation():
    conversation = header(CLAUDE_CODE[0], "x-claude-code-session-id")
    a1 = header(CLAUDE_CODE[1], "x-claude-code-agent-id")
    a2 = header(CLAUDE_CODE[2], "x-claude-code-agent-id")
    a3 = header(CLAUDE_CODE[4], "x-claude-code-agent-id")
    main, sub, nested, other = (
        conversation,
        f"{conversation}.{a1}",
        f"{conversation}.{a2}",
        f"{conversation}.{a3}",
    )
    assert lineage(CLAUDE_CODE) == [
        (main, None, None),
        (sub, main, main),
        (nested, sub, main),
        (sub, main, main),
        (other, sub, main),
        (sub, main, main),
        (main, None, None),
    ]
    assert tree_of(CLAUDE_CODE) == {main: {sub: {nested: {}, other: {}}}}
    # metadata.user_id names the main conversation on every request: as a session signal it
    # would merge the agents; the headers win.
    assert lineage(CLAUDE_CODE, body=["metadata.user_id"]) == lineage(CLAUDE_CODE)


def test_codex_threads_are_sessions_and_its_session_id_is_the_root():
    t0 = header(CODEX[0], "thread-id")
    t1 = header(CODEX[1], "thread-id")
    t2 = header(CODEX[4], "thread-id")
    assert {header(h, "session-id") for h in CODEX} == {t0}
    assert lineage(CODEX) == [
        (t0, None, None),
        (t1, t0, t0),
        (t0, None, None),
        (t1, t0, t0),
        (t2, t1, t0),
        (t1, t0, t0),
        (t0, None, None),
    ]
    assert tree_of(CODEX) == {t0: {t1: {t2: {}}}}


def test_codex_per_thread_request_id_and_turn_metadata_are_not_read():
    sub = CODEX[1]
    # x-client-request-id repeats the thread id (it is no per-request id for Codex), and
    # x-codex-turn-metadata repeats the lineage: neither is needed, neither is read.
    assert header(sub, "x-client-request-id") == header(sub, "thread-id")
    only = [(k, v) for k, v in sub if k.lower() not in ("thread-id", "x-codex-parent-thread-id", "session-id")]
    assert read(only).session is None
    # session-id alone is the main thread's id, never a session of its own
    assert read([(k, v) for k, v in sub if k.lower() != "thread-id"]).session is None


def test_opencode_sessions_and_parents():
    o0 = header(OPENCODE[0], "x-session-affinity")
    o1 = header(OPENCODE[2], "x-session-affinity")
    o2 = header(OPENCODE[3], "x-session-affinity")
    assert lineage(OPENCODE) == [
        (o0, None, None),
        (o0, None, None),
        (o1, o0, None),
        (o2, o1, None),
        (o1, o0, None),
        (o0, None, None),
    ]
    assert tree_of(OPENCODE) == {o0: {o1: {o2: {}}}}


AIPERF_CHILD = {
    "X-Correlation-ID": "corr-child",
    "X-Request-ID": "req-7",
    "X-Session-Affinity": "corr-child",
    "X-Dynamo-Session-ID": "corr-child",
    "X-Dynamo-Parent-Session-ID": "corr-root",
    "User-Agent": "aiperf/0.13.0",
}


def test_aiperf_keeps_its_correlation_id_and_dynamo_parent():
    assert lineage([list(AIPERF_CHILD.items())]) == [("corr-child", "corr-root", None)]


def mixed() -> dict[str, str]:
    """A request carrying the session headers of every family (a harness that adds its own)."""
    return {
        "X-Correlation-ID": "corr",
        "X-Parent-Session-ID": "corr-parent",
        "x-claude-code-session-id": "conv",
        "x-claude-code-agent-id": "agent",
        "thread-id": "thread",
        "x-codex-parent-thread-id": "parent-thread",
        "session-id": "main-thread",
    }


@pytest.mark.parametrize(
    ("clients", "expected"),
    [
        (None, ("corr", "corr-parent", None)),
        (["claude_code", "codex", "generic"], ("conv.agent", "conv", "conv")),
        (["codex", "claude_code", "generic"], ("thread", "parent-thread", "main-thread")),
        (["codex"], ("thread", "parent-thread", "main-thread")),
    ],
)
def test_several_families_resolve_by_the_order_of_clients_never_mixed(clients, expected):
    cfg = {} if clients is None else {"clients": clients}
    ident = read(mixed(), **cfg)
    assert (ident.session, ident.parent, ident.root) == expected


def test_families_are_never_mixed():
    # a generic session with Claude Code's agent header: the agent header belongs to the other family
    ident = read({"X-Session-ID": "s", "x-claude-code-agent-id": "a", "x-codex-parent-thread-id": "t"})
    assert (ident.session, ident.parent, ident.root) == ("s", None, None)
    # a Claude Code request with a generic parent header: the generic one is not read
    ident = read({"x-claude-code-session-id": "conv", "X-Parent-Session-ID": "elsewhere"})
    assert (ident.session, ident.parent, ident.root) == ("conv", None, None)


def test_a_family_left_out_is_not_read():
    assert read(CLAUDE_CODE[1], clients=["generic", "codex"]).session is None
    assert read(CODEX[1], clients=["generic", "claude_code"]).session is None
    assert read(OPENCODE[2], clients=["claude_code", "codex"]).session is None
    assert read(OPENCODE[2], clients=[]).session is None


def test_the_final_flag_is_read_for_every_family():
    for headers in (CLAUDE_CODE[2], CODEX[4], OPENCODE[3]):
        assert read([*headers, ("X-Session-Final", "true")]).final is True
        assert read(headers).final is False


def test_a_nested_agent_names_its_parent_agent_exactly_as_that_agent_is_named():
    conversation = "c" * 600  # longer than sessions.max_id_bytes: every id fitted alike
    first = read({"x-claude-code-session-id": conversation, "x-claude-code-agent-id": "a1"})
    nested = read(
        {
            "x-claude-code-session-id": conversation,
            "x-claude-code-agent-id": "a2",
            "x-claude-code-parent-agent-id": "a1",
        }
    )
    assert first.session == fit_id(agent_session(conversation, "a1"), 512) != nested.session
    assert nested.parent == first.session
    assert nested.root == first.root == first.parent == fit_id(conversation, 512)
    # an agent naming itself as its parent is a first-level agent
    self_parent = read(
        {"x-claude-code-session-id": "c", "x-claude-code-agent-id": "a", "x-claude-code-parent-agent-id": "a"}
    )
    assert (self_parent.session, self_parent.parent) == ("c.a", "c")


def test_the_reader_names_every_header_it_consumes():
    names = IdentityReader(IdentityConfig()).header_names
    assert {*ID_HEADERS, "x-correlation-id", "x-session-final"} <= names
    assert "x-client-request-id" not in names and "x-request-id" not in names
    assert "thread-id" not in IdentityReader(IdentityConfig(clients=["generic"])).header_names


@pytest.mark.parametrize(
    ("identity", "message"),
    [
        (
            {"session": ["X-Correlation-ID", "thread-id"]},
            "identity.session: 'thread-id' is read by the codex client family (identity.clients): remove it here, "
            "or remove codex from identity.clients",
        ),
        (
            {"parent": "x-claude-code-parent-agent-id"},
            "identity.parent: 'x-claude-code-parent-agent-id' is read by the claude_code client family",
        ),
        (
            {"clients": ["claude_code"], "root": ["X-Root-Session-ID"]},
            "identity.root: applies to the generic client family, which identity.clients leaves out",
        ),
        ({"clients": ["codex", "codex"]}, "identity.clients: names 'codex' twice"),
        ({"clients": ["aider"]}, "identity.clients[0]: Input should be 'generic', 'claude_code' or 'codex'"),
    ],
)
def test_client_families_are_validated_with_the_setting_named(identity, message):
    with pytest.raises(ConfigError) as exc:
        _with_file({"upstream": "http://127.0.0.1:1"}, {"identity": identity})
    assert message in str(exc.value)


def test_a_client_header_is_a_generic_signal_once_its_family_is_off():
    ident = read({"thread-id": "t", "X-Parent-Session-ID": "p"}, clients=["generic"], session=["thread-id"])
    assert (ident.session, ident.parent) == ("t", "p")
