"""The one batched decoding engine: continuous batching of plain or joint neg+pos decoding, with verifier states.

:class:`DecodeEngine` keeps a running batch of requests over an mlx-lm
``BatchKVCache``.  Requests join and leave at token boundaries: each
:meth:`~DecodeEngine.step` admits waiting requests (up to ``max_batch`` rows),
picks one token for every row from one batched forward pass, and drops the
rows that stopped.  Every verb decodes through it: ``serve``, ``generate``,
``chat``, ``network-train``'s per-epoch decoding (:func:`sdm_mlx.network.generation.greedy_generate`).

* **Prefill from the prompt cache, in right-padded passes.**  New requests
  whose prompts start with the same cached prefix (:class:`~.prompt_cache.PrefixCache`)
  run their own tokens together, on KV caches that start from that prefix;
  they are sorted by length and split where padding would cost more than
  another pass (:func:`~.batch_plan.length_chunks`).  Right padding cannot change a row's
  states (the mask is causal and the pads come last), so a row's prompt states
  do not depend on the other rows (up to float rounding), and the shared
  system/instruction/template prefix is computed once.  The caches are then
  merged into the running batch (left padded there; positions and the
  attention mask exclude the padding).
* **Decoding.**  Plain: the token is picked from the base model's logits
  (``argmax`` by default); joint (``heads``: an :class:`~sdm_mlx.network.heads.SDMHeads`):
  from ``concat(z_neg, z_pos)`` and emits ``index mod |V|``.  Sampling fields:
  :mod:`.sampling`.  The decode-step states of a row come from a batched
  matrix product and may differ from a batch of one by float rounding
  (~1e-7 relative); greedy ties are broken by the lowest index in both cases.
  When every row is greedy, a step queues the forward pass that feeds its
  picks before it reads them (:meth:`~DecodeEngine._step_ahead`, as mlx-lm's
  ``generate_step`` and ``BatchGenerator``), so building the next graph and
  the per-row Python work overlap the computation; rows that sample pick
  first, then feed.
* **Stopping, per request.**  The verification unit is closed (for ``"}"`` the
  brace that balances the first ``{``, :func:`~sdm_mlx.network.generation.is_closed`),
  an end-of-sequence token (not kept), ``max_tokens``, a ``stop`` string (the
  text is cut before it), or the request's ``cancel()`` returns True.
* **Streaming.**  ``on_text`` gets mlx-lm's detokenized segments; ``on_tokens``
  gets text released at token boundaries with the logprobs records of exactly
  the tokens it completes (:class:`~.streaming.AnswerStream`).  A logprobs
  record's ``token`` is the text the token adds to the answer
  (:class:`~.streaming.TokenPieces`), so the records join to it.
* **Verifier states.**  With ``features=True`` a request keeps the final-norm
  states of its prompt and of each fed token, and its :class:`Decoded`
  carries the verifier input pooled from its own rows by
  :func:`sdm_mlx.llm.embed.pool_hidden` over ``n`` positions (:func:`sdm_mlx.llm.embed.generated_n_kept`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..llm import embed as _embed
from ..errors import InputError
from ..llm.answers import is_closed
from ..llm.model import model_dims
from .batch_plan import decodes_in_batches, plain_kv_caches, prefill_batches
from .prompt_cache import PrefixCache, common_prefix_length
from .decode_types import STOP_REASONS, Decoded, DecodeRequest, check_request
from .kept import attach_kept, prompt_kv
from .sampling import RowSampler, token_logprobs
from .streaming import AnswerStream, cut_at_stop, first_stop

__all__ = ["STOP_REASONS", "DecodeEngine", "DecodeRequest", "Decoded"]


@dataclass
class _Row:
    req: DecodeRequest
    sampler: RowSampler
    t0: float
    cached: int = 0
    tokens: list = field(default_factory=list)
    states: list = field(default_factory=list)
    logprobs: list | None = None
    first: float | None = None
    stream: AnswerStream | None = None
    prompt_kv: list | None = None


class DecodeEngine:
    """Continuous batching over one model (see the module docstring).

    ``heads``: an ``SDMHeads`` for joint neg+pos decoding, else plain decoding.  ``prefix_cache``: a
    :class:`PrefixCache` (default: one of :data:`~.prompt_cache.DEFAULT_MAX_BYTES`), or ``False``.
    Models with their own cache types (``make_cache`` making other than plain ``KVCache``: sliding windows,
    SSMs; :func:`~.batch_plan.plain_kv_caches`) prefill each prompt alone and decode in batches of mlx-lm's
    merged caches (:func:`decodes_in_batches`; one row at a time when a cache type does not merge), without
    the prompt cache.
    """

    def __init__(self, model, tokenizer, heads=None, *, delimiter: str = _embed.DEFAULT_DELIMITER,
                 max_batch: int = 16, max_length: int = _embed.DEFAULT_MAX_LENGTH, prefix_cache=None):
        if not delimiter:
            raise InputError("delimiter must be a non-empty string")
        if max_batch < 1:
            raise InputError("max_batch must be >= 1")
        self.model, self.tokenizer, self.heads = model, tokenizer, heads
        self.delimiter, self.max_length = delimiter, int(max_length)
        self.batchable = plain_kv_caches(model)  # BatchKVCache prefill passes and the prompt cache
        self.merges = decodes_in_batches(model)  # the model's own caches merge into a running batch
        self.max_batch = int(max_batch) if self.merges else 1
        if prefix_cache is None:
            prefix_cache = PrefixCache()
        self.prefix_cache = prefix_cache if (prefix_cache is not False and self.batchable) else None
        self.vocab = model_dims(model)[0]
        self.eos = _embed.eos_token_ids(tokenizer)
        self.xtc_special = tuple(_embed.encode(tokenizer, "\n")) + tuple(self.eos)  # as mlx_lm.server's
        self.pending: deque = deque()
        self.rows: list[_Row] = []
        self.cache = None   # per-layer BatchKVCache of the running rows
        self.H = None       # [B, D] final-norm state each row picks its next token from
        self._ahead, self._ahead_rows = None, 0  # argmax picks of the first rows, computed ahead (lazy)
        self._last_char: dict = {}  # token id -> its text holds the delimiter's last character (_holds_last)

    @property
    def mode(self) -> str:
        return "plain" if self.heads is None else "joint"

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.rows)

    def reset(self) -> None:
        """Drop every waiting and running request (their callers are told by the owner)."""
        self.pending.clear()
        self.rows, self.cache, self.H, self._ahead = [], None, None, None

    def submit(self, req: DecodeRequest) -> DecodeRequest:
        """Queue ``req`` (validated here); it joins the batch at the next step with room."""
        check_request(req)
        req.prompt_ids = [int(t) for t in req.prompt_ids]
        self.pending.append(req)
        return req

    def run(self, requests: Sequence[DecodeRequest], progress: Callable[[int], None] | None = None) -> list:
        """Decode ``requests`` to the end: their :class:`Decoded`, in order."""
        for r in requests:
            self.submit(r)
        out: dict = {}
        while self.busy:
            done = self.step()
            for req, dec in done:
                out[id(req)] = dec
            if progress is not None and done:
                progress(len(done))
        return [out[id(r)] for r in requests]

    def step(self) -> list:
        """Admit waiting requests, pick one token for every row: the ``(request, Decoded)`` pairs that finished."""
        done: list = []
        self._admit(done)
        if self.rows:
            if self._all_argmax():
                self._step_ahead(done)
            else:
                self._step_sampled(done)
        return done

    def _step_ahead(self, done: list) -> None:
        """Every row greedy: the pass that feeds this step's picks is queued on them (lazy) before they are read
        (see the module docstring).  A row that stops here was fed its last token in that pass too; :meth:`_filter`
        drops it with its extra state."""
        import mlx.core as mx

        picks = self._ahead_picks()
        h = _embed.hidden_states(self.model, picks[:, None], cache=self.cache)[:, 0, :]
        nxt = self._argmax(h)
        mx.async_eval(nxt)
        keep = self._accept_picks(picks.tolist(), None, done)
        self._keep_states(h, keep)
        self.H, self._ahead, self._ahead_rows = h, nxt, len(self.rows)
        if len(keep) < len(self.rows):
            self._filter(keep)

    def _step_sampled(self, done: list) -> None:
        """Some row samples (or wants logprobs): pick every row's token, then feed the picks (the next step's
        :meth:`_ahead_picks` starts from these states when every row left is greedy)."""
        import mlx.core as mx

        picks, lps = self._pick()
        keep = self._accept_picks(picks, lps, done)
        if len(keep) < len(self.rows):
            self._filter(keep)
        if not self.rows:
            return
        x = mx.array([[row.tokens[-1]] for row in self.rows], dtype=mx.int32)
        self.H = _embed.hidden_states(self.model, x, cache=self.cache)[:, 0, :]
        self._keep_states(self.H, range(len(self.rows)))
        mx.async_eval(self.H)

    def _accept_picks(self, picks: list, lps, done: list) -> list:
        """Take every row's pick (and its log-probabilities, ``lps``: None or per row); finished rows go to
        ``done``; returns the indices of the rows that go on."""
        keep = []
        for i, row in enumerate(self.rows):
            reason = self._accept(row, picks[i], None if lps is None else lps[i])
            if reason is None:
                keep.append(i)
            else:
                done.append((row.req, self._finish(row, reason)))
        return keep

    def _keep_states(self, h, rows) -> None:
        """Append each of ``rows``' state (``h[i]``, after feeding its pick) to the rows that want features."""
        for i in rows:
            if self.rows[i].req.keeps_states:
                self.rows[i].states.append(h[i : i + 1])

    def _all_argmax(self) -> bool:
        return all(r.sampler.params.plain_argmax and r.logprobs is None for r in self.rows)

    def _argmax(self, h):
        import mlx.core as mx

        return mx.argmax(self._logits(h), axis=-1) % self.vocab

    def _ahead_picks(self):
        """The greedy picks of every row (lazy): those computed ahead, then those of rows admitted since."""
        import mlx.core as mx

        ahead, n, self._ahead = self._ahead, self._ahead_rows, None
        if ahead is None:
            return self._argmax(self.H)
        if n < len(self.rows):
            ahead = mx.concatenate([ahead, self._argmax(self.H[n:])])
        return ahead

    # -- admission ----------------------------------------------------------------------------------------
    def _admit(self, done: list) -> None:
        import mlx.core as mx

        fresh = []
        while self.pending and len(self.rows) + len(fresh) < self.max_batch:
            req = self.pending.popleft()
            if req.cancel is not None and req.cancel():
                done.append((req, Decoded(req.prompt_ids, [], "", "cancelled", 0.0)))
            else:
                fresh.append(req)
        if not fresh:
            return
        if not self.batchable:  # the model's own cache types: each prompt alone, then merged into batch caches
            rows, hs, caches = [], [], []
            for req in fresh:
                row, kv, h = self._prefill_alone(req)
                rows.append(row)
                hs.append(h)
                caches.append(kv)
            joined = [type(layer[0]).merge(list(layer)) for layer in zip(*caches)] if self.merges else caches[0]
        else:
            self._warm_prefix(fresh)
            groups: dict = {}
            for req in fresh:  # requests sharing a cached prefix are prefilled together
                hit = self.prefix_cache.lookup(req.prompt_ids) if self.prefix_cache is not None else None
                groups.setdefault(None if hit is None else id(hit[1]), (hit, []))[1].append(req)
            rows, hs, joined = [], [], None
            for hit, reqs in prefill_batches(groups.values()):
                g_rows, g_cache, g_h = self._prefill_group(reqs, hit)
                rows += g_rows
                hs.append(g_h)
                if joined is None:
                    joined = g_cache
                else:
                    for c, new in zip(joined, g_cache):
                        c.extend(new)
        if self.rows:
            for c, new in zip(self.cache, joined):
                c.extend(new)
            self.H = mx.concatenate([self.H] + hs, axis=0)
        else:
            self.cache, self.H = joined, mx.concatenate(hs, axis=0)
        self.rows.extend(rows)
        mx.async_eval(self.H)  # read with the first picks (no pipeline bubble here)

    def _new_row(self, req: DecodeRequest, t0: float, cached: int, states) -> _Row:
        row = _Row(req=req, sampler=RowSampler(req.sampling, self.vocab, self.xtc_special), t0=t0, cached=cached)
        if req.keeps_states:
            row.states.append(states)
        if req.sampling.logprobs:
            row.logprobs = []
        if req.sampling.logprobs or req.on_text is not None or req.on_tokens is not None:
            row.stream = AnswerStream(self.tokenizer, stop=req.stop, on_text=req.on_text, on_tokens=req.on_tokens,
                                      pieces=req.sampling.logprobs)
        return row

    def _warm_prefix(self, reqs: list) -> None:
        """Prefill once, into the prompt cache, the prefix that new requests share when none is cached yet."""
        cache = self.prefix_cache
        if cache is None or len(reqs) < 2 or any(cache.lookup(r.prompt_ids, count=False) for r in reqs):
            return
        first = reqs[0].prompt_ids
        share = min(common_prefix_length(first, r.prompt_ids) for r in reqs[1:])
        share = min(share, min(len(r.prompt_ids) for r in reqs) - 1)
        if share >= cache.min_tokens:
            kv, states = self._run_alone(first[:share])
            cache.put(first[:share], [(c.keys, c.values) for c in kv], states)

    def _run_alone(self, ids: list, hit=None):
        """``(per-layer KV caches, final-norm states [len(ids) - start, D])`` of ``ids`` run alone."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        kv = make_prompt_cache(self.model)
        start = 0
        if hit is not None:
            start, prefix_kv, _ = hit
            for c, (k, v) in zip(kv, prefix_kv):
                c.keys, c.values, c.offset = k, v, start
        h = _embed.hidden_states(self.model, [ids[start:]], cache=kv)[0]
        mx.eval(h)
        return kv, h

    def _prefill_alone(self, req: DecodeRequest):
        """One prompt on the model's own cache types: ``(row, caches, last state [1, D])`` (no prompt cache)."""
        t0 = time.perf_counter()
        kv, h = self._run_alone(req.prompt_ids)
        return self._new_row(req, t0, 0, h), kv, h[-1:]

    def _prefill_group(self, reqs: list, hit):
        """Prompts that share the cached prefix ``hit`` (or none), prefilled in one right-padded batch.

        Right padding cannot change a row's states (every pad comes after its tokens, the mask is causal);
        ``BatchKVCache.finalize`` then rolls each row's pads to the left, where the running batch's mask
        excludes them.  Returns ``(rows, per-layer BatchKVCache, last states [B, D])``.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import BatchKVCache

        t0 = time.perf_counter()
        start, prefix_kv, prefix_states = hit if hit is not None else (0, None, None)
        rest = [r.prompt_ids[start:] for r in reqs]
        lens = [len(x) for x in rest]
        width, B = max(lens), len(reqs)
        cache = [BatchKVCache([0] * B) for _ in _embed.trunk(self.model).layers]
        if prefix_kv is not None:
            for c, (k, v) in zip(cache, prefix_kv):
                c.keys, c.values = mx.repeat(k, B, axis=0), mx.repeat(v, B, axis=0)
                c.offset, c._idx = c.offset + start, start
        for c in cache:
            c.prepare(lengths=lens, right_padding=[width - n for n in lens])
        h = _embed.hidden_states(self.model, rest, cache=cache)  # right-padded here
        for c in cache:
            c.finalize()
        rows, last = [], []
        for i, (req, n) in enumerate(zip(reqs, lens)):
            states = h[i, :n] if prefix_states is None else mx.concatenate([prefix_states, h[i, :n]], axis=0)
            kv_i = None
            if self.prefix_cache is not None or req.keep_prompt:
                pad = width - n
                kv_i = [(c.keys[i : i + 1, :, pad:], c.values[i : i + 1, :, pad:]) for c in cache]
            if self.prefix_cache is not None:
                self.prefix_cache.offer(req.prompt_ids, kv_i, states, cached=start)
            rows.append(self._new_row(req, t0, start, states))
            rows[-1].prompt_kv = prompt_kv(kv_i, len(req.prompt_ids)) if req.keep_prompt else None
            last.append(h[i, n - 1 : n])
        return rows, cache, mx.concatenate(last, axis=0)

    # -- one step -------------------------------------------------------------------------------------------
    def _logits(self, h):
        import mlx.core as mx

        if self.heads is not None:
            return self.heads.joint_logits(h)
        return _embed.logits_from_hidden(self.model, h).astype(mx.float32)

    def _pick(self):
        """Token ids for every row and their log-probabilities (per row; None for rows that need none)."""
        import mlx.core as mx

        self._ahead = None
        logits = self._logits(self.H)
        chosen = [r.sampler.choose(logits[i : i + 1], r.tokens) for i, r in enumerate(self.rows)]
        idx = mx.concatenate([c[0].reshape(1) for c in chosen])
        mx.eval(idx)
        return (idx % self.vocab).tolist(), [c[1] for c in chosen]

    def _accept(self, row: _Row, t: int, logprobs) -> str | None:
        """Take token ``t`` into ``row``; the stop reason, or None to continue."""
        if row.first is None:
            row.first = time.perf_counter() - row.t0
        if t in self.eos:
            return "eos"
        req = row.req
        row.tokens.append(t)
        record = None
        if row.logprobs is not None:
            record = token_logprobs(logprobs[0], t, self.vocab, req.sampling.top_logprobs, self.tokenizer)
            row.logprobs.append(record)
        if row.stream is not None and not row.stream.add(t, record):
            return "cancelled"
        if req.stop_at_delimiter and self._closes(row.tokens, t):
            return "delimiter"
        if req.stop and first_stop(self.tokenizer.decode(row.tokens), req.stop) is not None:
            return "stop"
        if len(row.tokens) >= req.max_tokens:
            return "max_tokens"
        if req.cancel is not None and req.cancel():
            return "cancelled"
        return None

    def _closes(self, tokens: list, t: int) -> bool:
        if self.delimiter[-1].isascii() and not self._holds_last(t):
            return False  # an ASCII delimiter character cannot be split across tokens
        return is_closed(self.tokenizer.decode(tokens), self.delimiter)

    def _holds_last(self, t: int) -> bool:
        """Whether token ``t``'s text holds the delimiter's last character (memoised: a decode costs 20-30 µs)."""
        held = self._last_char.get(t)
        if held is None:
            held = self._last_char[t] = self.delimiter[-1] in self.tokenizer.decode([t])
        return held

    def _filter(self, keep: list) -> None:
        import mlx.core as mx

        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.H, self._ahead = None, None, None
            return
        idx = mx.array(keep, dtype=mx.int32)
        for c in self.cache:
            c.filter(keep)
        self.H = self.H[idx]
        if self._ahead is not None:
            self._ahead, self._ahead_rows = self._ahead[idx], len(keep)

    # -- a finished row -------------------------------------------------------------------------------------
    def _finish(self, row: _Row, reason: str) -> Decoded:
        import mlx.core as mx

        tokens = row.tokens
        text = self.tokenizer.decode(tokens)
        if reason == "stop":
            text, tokens = cut_at_stop(self.tokenizer, text, tokens, row.req.stop)
        if row.stream is not None:
            row.stream.end(len(tokens), row.logprobs[-1] if row.logprobs else None)
        dec = Decoded(row.req.prompt_ids, tokens, text, reason, time.perf_counter() - row.t0,
                      logprobs=None if row.logprobs is None else row.logprobs[: len(tokens)],
                      first_token_seconds=row.first, cached_prompt_tokens=row.cached,
                      error=None if row.stream is None else row.stream.error)
        states = mx.concatenate(row.states, axis=0) if row.states else None
        if row.req.features:
            n, info = _embed.generated_n_kept(self.tokenizer, len(row.req.prompt_ids), tokens,
                                              delimiter=self.delimiter, max_length=self.max_length,
                                              on_missing="prompt")
            dec.features = _embed.pool_hidden(states, n, parts=row.req.feature_parts).reshape(1, -1)
            dec.feature_info = {"n_kept": int(n), **info}
        if states is not None:
            attach_kept(dec, row.req, states, row.prompt_kv, reason)
        return dec
