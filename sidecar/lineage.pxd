# Compiled layout of lineage.py (Cython "augmenting" declarations; see setup.py): the tree's
# nodes and per-request handles as extension types. Keep _Node's and Turn's fields equal to
# their __slots__, and SessionTree's to the attributes its __init__ sets; the per-request
# methods' signatures must match lineage.py.
cimport cython
from sidecar.context cimport RoutingContext

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(object op)

cdef bint _COMPILED

cdef class _Node:
    cdef public object session, deployment, end_reason, mode_state, workers
    cdef public _Node parent, root, first_child, next_sibling, prev_sibling, lru_prev, lru_next
    cdef public double created_at, last_active_at
    cdef public long turns, in_flight, flags, tree_live, tree_in_flight, worker_turns, moves

cdef _Node _RELEASED

cdef class Turn:
    cdef public RoutingContext ctx
    cdef public _Node _node
    cdef public bint _final, _open

cdef class SessionTree:
    cdef public double _idle_ttl, _tombstone_ttl
    cdef public long _max_live, _tombstone_max, _live, _held_ended, _trees
    cdef public long evictions, tombstone_reuses, root_conflicts, lineage_dropped
    cdef public object _clock, _tombs
    cdef public dict _nodes, ended_by_reason
    cdef public _Node _lru
    cdef public dict _detached
    cdef public bint _conflict_logged, _shared
    @cython.locals(node=_Node, root=_Node, parent_node=_Node, prev=_Node, nxt=_Node, flags=long, pflags=long,
                   in_flight=long, turns=long, ctx=RoutingContext, turn=Turn)
    cpdef begin(self, session, parent, root_hint, final, deployment)
    @cython.locals(node=_Node, root=_Node, in_flight=long)
    cpdef finish(self, Turn turn, outcome)
    @cython.locals(nodes=dict)
    cdef _index(self, session, _Node node)

@cython.locals(tail=_Node)
cdef void _lru_append(_Node lru, _Node node)

cdef object _uncollected(object obj)

# _Node.flags bits as C constants (compiled, every test of a flag would otherwise combine Python
# ints); internal to this module.
cdef long _PLACEHOLDER, _FINAL_SEEN, _CLOSED, _ENDED, _HINTED, _CONFLICT, _DETACHED, _NOT_JOINABLE, _DONE
