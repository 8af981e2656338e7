"""The worker side of asynchronous saves: which requests have saves in flight, and when vLLM may
have their blocks back.

vLLM 0.32's contract (kv_connector/v1/base.py, v1/core/sched/scheduler.py), and how the connector
keeps every block it copies owned by its request until the copy is done:

* **Finished and aborted requests.** ``Scheduler._free_request`` (end of generation, and
  ``finish_requests`` for aborts) calls the connector's ``request_finished``; when it returns True,
  the blocks stay allocated to the request until a worker reports its id in ``finished_sending``
  from ``get_finished``; the engine keeps stepping meanwhile (``has_finished_requests`` counts such
  requests), and ``get_finished`` runs on empty steps too. The scheduler side returns True for
  every request that had a save in some step's metadata (``_ReqState.saving``); every worker rank
  notes the same requests from the same metadata (:meth:`SaveTracker.note`, even where it skipped
  the copy), so each rank reports each of them exactly once, once its own copies are done. vLLM's
  aggregator waits for every rank (``get_finished_count`` is None: the world size).
* **Preempted requests.** ``Scheduler._preempt_request`` frees the blocks at once, without asking
  the connector, and the same ``schedule()`` may hand them to another request whose forward
  writes them in this very step. The worker's ``handle_preemptions(metadata)`` runs before that
  step's state update and forward (``GPUModelRunner.execute_model``, which the CPU runner
  inherits), so there the worker waits for the in-flight saves of the requests in
  ``SchedulerOutput.preempted_req_ids`` (carried in the connector's metadata): no block is
  overwritten while a save reads it. The request's saves planned but held (issue 7) are dropped
  by the scheduler side as before.
* Blocks of a running request are written only at positions past its computed tokens: a full block
  that a save copies does not change while the request runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from cxlkv.integrations.transfer import BlockOp, SaveHandle


class SaveTracker:
    def __init__(self) -> None:
        self._inflight: dict[str, list[tuple[BlockOp, SaveHandle]]] = {}
        self._noted: set[str] = set()  # requests whose id goes to finished_sending once done
        self._finishing: set[str] = set()  # finished per the scheduler, copies still running

    def note(self, req_id: str) -> None:
        """The scheduler sent a save of this request (and so delays freeing its blocks)."""
        self._noted.add(req_id)

    def add(self, op: BlockOp, handle: SaveHandle) -> None:
        self._inflight.setdefault(op.req_id, []).append((op, handle))

    def busy(self) -> bool:
        return any(self._inflight.values())

    def pending(self, req_ids: Iterable[str]) -> int:
        """Saves of these requests still copying."""
        return sum(not h.done() for rid in req_ids for _, h in self._inflight.get(rid, ()))

    def wait_for(self, req_ids: Iterable[str]) -> None:
        """Blocks until every save of these requests has finished copying."""
        for rid in req_ids:
            for _, h in self._inflight.get(rid, ()):
                h.result()

    def wait_all(self) -> None:
        self.wait_for(list(self._inflight))

    def completed(self) -> list[tuple[BlockOp, SaveHandle]]:
        """The saves that finished since the last call (each returned once)."""
        out: list[tuple[BlockOp, SaveHandle]] = []
        for rid in list(self._inflight):
            running: list[tuple[BlockOp, SaveHandle]] = []
            for x in self._inflight[rid]:
                (out if x[1].done() else running).append(x)
            if running:
                self._inflight[rid] = running
            else:
                del self._inflight[rid]
        return out

    def finished_sending(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Of the requests vLLM finished (this call's and earlier ones'), those noted whose copies
        are all done: vLLM frees their blocks. Call after :meth:`completed`."""
        self._finishing.update(r for r in finished_req_ids if r in self._noted)
        ready = {r for r in self._finishing if not self._inflight.get(r)}
        self._finishing -= ready
        self._noted -= ready
        return ready


def async_saves_enabled(extra: dict) -> bool:
    """kv_connector_extra_config's ``async_saves``: true (the default) or false, nothing else (a
    string "false" would otherwise read as true)."""
    value = extra.get("async_saves", True)
    if not isinstance(value, bool):
        raise ValueError(f"cxlkv: async_saves must be true or false, not {value!r}")
    return value
