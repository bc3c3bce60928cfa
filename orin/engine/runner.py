"""Executes a scheduler Batch through llama.cpp's low-level API.

``decode`` returns once the batch has been computed: ``llama_decode`` only
queues the work on a GPU backend (CUDA returns before the kernels finish), so
it is followed by ``llama_synchronize``. Step end timestamps, TTFT/TPOT and the
telemetry's phase boundaries are taken after ``decode`` and so cover the GPU's
work. The call is made on every build: on the CPU backend the decode has
already finished and it costs 2-3 microseconds (docs/performance.md,
"Synchronizing after each decode"), and no flag can tell reliably whether part
of a graph ran asynchronously (a GPU build offloads prompt matrix products
even with no layers offloaded).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from orin.engine.backend import Backend
from orin.engine.errors import BackendError
from orin.engine.scheduler import Batch, Copy, KVOp, Load, LoadFailed, Remove
from orin.llamacpp import abort_handled, note_abort

DECODE_ABORTED = 2  # llama_decode's return value when the abort callback fired


def _nothing() -> None:
    pass


class Aborted(Exception):
    """llama_decode stopped early because the abort callback asked it to."""


class Runner:
    def __init__(self, backend: Backend, n_batch: int) -> None:
        self.backend = backend
        # restores a saved prompt into an empty sequence (the persistent prompt cache,
        # set by the engine): (seq, entry) -> whether it worked
        self.load: Callable[[int, object], bool] = lambda seq, entry: False
        # called just before a call that runs long without the GIL (each llama_decode,
        # a saved prompt's restore): the engine hands its held events over there
        self.before_wait: Callable[[], None] = _nothing
        self.lib = backend.lib
        self.n_batch = n_batch
        self.batch = self.lib.llama_batch_init(n_batch, 0, 1)
        # the batch's arrays, fetched once: each field read of the ctypes struct makes a
        # new pointer object, and decode writes five per token
        b = self.batch
        self._arrays = (b.token, b.pos, b.n_seq_id, b.seq_id, b.logits)
        self.embd_batch: Any = None  # image rows (orin.engine.vision), made on first use
        self._abort_check: Callable[[], bool] | None = None
        self._abort_cb: Any = self.lib.ggml_abort_callback(self._on_abort)
        self._abort_set = False
        self._out_of_row: dict[int, int] = {}  # batch position -> output row, last decode
        # slot -> batch position of the first token of its chunk with logits at every
        # position (BatchItem.logits_all), last decode
        self.all_rows: dict[int, int] = {}
        self._view: tuple[int, int, npt.NDArray[np.float32]] | None = None  # addr, rows, view
        # llama_get_logits returning the address as an int: no pointer cast per step
        self._logits_addr = self.lib.llama_cpp._lib["llama_get_logits"]
        self._logits_addr.argtypes = [ctypes.c_void_p]
        self._logits_addr.restype = ctypes.c_void_p

    def _on_abort(self, _data: Any) -> bool:
        check = self._abort_check
        stop = bool(check and check())
        if stop:
            note_abort()  # the decode's lines about stopping are not errors
        return stop

    def apply(self, ops: Iterable[KVOp]) -> None:
        """Run the KV operations in order. A saved prompt that cannot be restored
        leaves its sequence empty; the others still run, then LoadFailed names them."""
        lib, mem = self.lib, self.backend.memory
        failed: list[int] = []
        for op in ops:
            if isinstance(op, Remove):
                if not lib.llama_memory_seq_rm(mem, op.seq, op.p0, op.p1):
                    raise BackendError(
                        f"llama.cpp could not remove cells {op.p0}..{op.p1} of sequence "
                        f"{op.seq} (a recurrent state only drops whole sequences)"
                    )
            elif isinstance(op, Copy):
                lib.llama_memory_seq_cp(mem, op.src, op.dst, -1 if op.p1 < 0 else 0, op.p1)
            elif isinstance(op, Load):
                self.before_wait()
                if not self.load(op.seq, op.entry):
                    lib.llama_memory_seq_rm(mem, op.seq, 0, -1)
                    failed.append(op.seq)
            else:
                start = op.keep + op.n_discard
                lib.llama_memory_seq_rm(mem, op.seq, op.keep, start)
                lib.llama_memory_seq_add(mem, op.seq, start, op.n_past, -op.n_discard)
        if failed:
            raise LoadFailed(failed)

    def decode(
        self,
        batch: Batch,
        abort: Callable[[], bool] | None = None,
        embeds: Mapping[int, npt.NDArray[np.float32]] | None = None,
    ) -> dict[int, int]:
        """Run the batch; return slot -> batch position of the logits to sample from
        (a speculating item's first; its other outputs follow it).

        ``embeds``: item index -> the embedding rows fed for that item's ids (image
        rows, orin.engine.vision). llama.cpp takes tokens or embeddings per call, so
        those items run first in a batch of their own, without outputs (a prompt
        never ends with an image), and the token batch, whose logits are read,
        second.

        ``abort`` (checked between graph nodes) is only installed for steps that
        carry prompt chunks: those are the long ones worth interrupting. Only the
        CPU backend checks it; on a GPU the decode runs to its end and the prompt
        chunk size bounds how long a cancelled request keeps running.
        """
        if batch.n_tokens > self.n_batch:
            raise BackendError(f"a batch of {batch.n_tokens} tokens exceeds n_batch {self.n_batch}")
        self._set_abort(abort)
        if embeds:
            self._decode_embeds(batch, embeds)
        b = self.batch
        token, position, n_seq_id, seq_id, logits = self._arrays
        n = 0
        rows: dict[int, int] = {}
        out_of_row: dict[int, int] = {}
        self._out_of_row = out_of_row
        if self.all_rows:
            self.all_rows = {}
        for index, item in enumerate(batch.items):
            if embeds and index in embeds:
                continue
            pos, slot = item.pos, item.slot
            for t in item.tokens:
                token[n] = t
                position[n] = pos
                n_seq_id[n] = 1
                seq_id[n][0] = slot
                logits[n] = False
                pos += 1
                n += 1
            if item.logits_all:  # every position's logits, the last one's sampled
                first = n - len(item.tokens)
                self.all_rows[slot] = first
                for row in range(first, n):
                    logits[row] = True
                    out_of_row[row] = len(out_of_row)
                if item.sample:
                    rows[slot] = n - 1
                continue
            if item.sample:
                first = n - item.outputs
                rows[slot] = first
                for row in range(first, n):
                    logits[row] = True
                    out_of_row[row] = len(out_of_row)
        b.n_tokens = n
        if n:
            self._run(b, n)
        return rows

    def _run(self, b: Any, n: int) -> None:
        ctx = self.backend.ctx
        self.before_wait()
        ret = self.lib.llama_decode(ctx, b)
        self.lib.llama_synchronize(ctx)  # the GPU has finished: the step may end now
        if self._abort_set:
            abort_handled()
        if ret == DECODE_ABORTED:
            raise Aborted()
        if ret != 0:
            raise BackendError(f"llama_decode failed with status {ret} on {n} tokens")

    def _decode_embeds(self, batch: Batch, embeds: Mapping[int, npt.NDArray[np.float32]]) -> None:
        """The items fed as embeddings, in one llama_batch of rows (no outputs)."""
        width = int(self.lib.llama_model_n_embd_inp(self.backend.model))
        if self.embd_batch is None:
            self.embd_batch = self.lib.llama_batch_init(self.n_batch, width, 1)
        b = self.embd_batch
        n = 0
        for index, rows in embeds.items():
            item = batch.items[index]
            if item.sample or rows.shape != (len(item.tokens), width):
                raise BackendError(f"slot {item.slot}: embedding rows do not match its chunk")
            data = np.ascontiguousarray(rows, dtype=np.float32)
            ctypes.memmove(
                ctypes.addressof(b.embd.contents) + n * width * 4, data.ctypes.data, data.nbytes
            )
            for j in range(len(item.tokens)):
                b.pos[n] = item.pos + j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = item.slot
                b.logits[n] = False
                n += 1
        b.n_tokens = n
        self._run(b, n)

    def _set_abort(self, check: Callable[[], bool] | None) -> None:
        self._abort_check = check
        want = check is not None
        if want != self._abort_set:  # a Python call per graph node costs: only when needed
            cb = self._abort_cb if want else self.lib.ggml_abort_callback(0)
            self.lib.llama_set_abort_callback(self.backend.ctx, cb, None)
            self._abort_set = want

    def outputs(self) -> npt.NDArray[np.float32]:
        """The last decode's logits, one row per sampled position in batch order (as
        llama.cpp stores them); a view valid until the next decode.

        The numpy view is built once and reused while llama.cpp keeps the same
        output buffer: building one per token costs more than the argmax.
        """
        n_rows = len(self._out_of_row)
        addr = self._logits_addr(self.backend.ctx) or 0
        view = self._view
        if view is None or view[0] != addr or view[1] != n_rows:
            ptr = ctypes.cast(addr, ctypes.POINTER(ctypes.c_float))
            array = np.ctypeslib.as_array(ptr, shape=(n_rows, self.backend.n_vocab))
            view = self._view = (addr, n_rows, array)
        return view[2]

    def chunk_logits(self, slot: int, n: int) -> npt.NDArray[np.float32]:
        """The logits of the ``n`` positions of ``slot``'s chunk that had every
        position's logits in the last decode, in order (a view valid until the next
        decode)."""
        first = self._out_of_row[self.all_rows[slot]]
        return self.outputs()[first : first + n]

    def logits(self, row: int) -> npt.NDArray[np.float32]:
        """A view of one batch position's logits (valid until the next decode)."""
        return self.outputs()[self._out_of_row[row]]

    def argmax(self, rows: list[int]) -> list[int]:
        """The greedy token of each batch position in ``rows``, in one numpy call."""
        outputs = self.outputs()
        if len(rows) == 1:  # one stream: no row gather, no list to build
            return [int(outputs[self._out_of_row[rows[0]]].argmax())]
        order = [self._out_of_row[r] for r in rows]
        if order != list(range(len(outputs))):
            outputs = outputs[order]
        return [int(t) for t in outputs.argmax(axis=1)]

    def seq_pos_min(self, seq: int) -> int:
        """The lowest position a sequence still holds (-1 when empty); with a window
        cache, older cells may be gone."""
        return int(self.lib.llama_memory_seq_pos_min(self.backend.memory, seq))

    def seq_pos_max(self, seq: int) -> int:
        return int(self.lib.llama_memory_seq_pos_max(self.backend.memory, seq))

    def close(self) -> None:
        if self.batch is not None:
            self._set_abort(None)
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        if self.embd_batch is not None:
            self.lib.llama_batch_free(self.embd_batch)
            self.embd_batch = None
