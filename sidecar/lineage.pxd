# Compiled layout of lineage.py (Cython "augmenting" declarations; see setup.py): the tree's
# nodes and per-request handles as extension types. Keep SessionNode's and Turn's fields equal to
# their __slots__, and SessionTree's to the attributes its __init__ sets; the per-request
# methods' signatures must match lineage.py.
cimport cython
from sidecar.context cimport RoutingContext

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(object op)

cdef bint _COMPILED

cdef class SessionNode:
    cdef public object session, deployment, end_reason, mode_state, workers
    cdef public SessionNode parent, root, first_child, next_sibling, prev_sibling, lru_prev, lru_next
    cdef public double created_at, last_active_at
    cdef public long turns, in_flight, flags, tree_live, tree_in_flight, worker_turns, moves
    cdef public long prompt_tokens, cached_tokens, usage_turns, unknown_turns

cdef SessionNode _RELEASED

cdef class Turn:
    cdef public RoutingContext ctx
    cdef public SessionNode node
    cdef public bint _final, _open

cdef class SessionTree:
    cdef public double _idle_ttl, _tombstone_ttl
    cdef public long _max_live, _tombstone_max, _live, _held_ended, _trees
    cdef public long evictions, tombstone_reuses, root_conflicts, lineage_dropped
    cdef public object _clock, _tombs
    cdef public dict _nodes, ended_by_reason
    cdef public SessionNode _lru
    cdef public dict _detached
    cdef public bint _conflict_logged, _shared
    @cython.locals(node=SessionNode, root=SessionNode, parent_node=SessionNode, prev=SessionNode, nxt=SessionNode, flags=long, pflags=long,
                   in_flight=long, turns=long, ctx=RoutingContext, turn=Turn)
    cpdef begin(self, session, parent, root_hint, final, deployment)
    @cython.locals(node=SessionNode, root=SessionNode, in_flight=long)
    cpdef finish(self, Turn turn, outcome)
    @cython.locals(node=SessionNode)
    cpdef record_usage(self, Turn turn, long long prompt_tokens, long long cached_tokens)
    @cython.locals(node=SessionNode)
    cpdef record_unknown_usage(self, Turn turn)
    @cython.locals(nodes=dict)
    cdef _index(self, session, SessionNode node)

@cython.locals(tail=SessionNode)
cdef void _lru_append(SessionNode lru, SessionNode node)

cdef object _uncollected(object obj)

# SessionNode.flags bits as C constants (compiled, every test of a flag would otherwise combine Python
# ints); internal to this module.
cdef long _PLACEHOLDER, _FINAL_SEEN, _CLOSED, _ENDED, _HINTED, _CONFLICT, _DETACHED, _NOT_JOINABLE, _DONE
