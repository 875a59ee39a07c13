"""The network trainer's embedding and decoding, split over the ranks of data-parallel training (:mod:`.data_parallel`):
each rank runs whole single-process batches and the results are gathered in the single-process order, so a run
over several ranks computes what one process would.  A mixin of :class:`~sdm_mlx.network.trainer.SDMNetworkTrainer`,
which holds ``config``, ``dp``, ``model``, ``tokenizer``, ``heads`` and ``out``; steps (a)-(c) and the calibration count
(e) of Alg. 4 call it.  Its long decodings keep what they finish in decode journals (:mod:`.decode_journal`), so a run
stopped in the middle of one decodes only the rest."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from ..llm import embed as _embed
from ..llm.pooling import verifier_parts
from ..storage.artifact_load import manifest_digest
from ..storage.files import strict
from ..storage.journal import ChunkJournal
from ..runtime.callbacks import progress_bar as Progress
from .data_parallel import weight_checksum
from .base_decodings import REPLAY_SETTINGS, BaseDecodings
from .decode_journal import JOURNAL_DIR, DecodeJournal, GivenDecodings, discard_journals, prompt_key
from .selection import count_verified, sum_counts
from .own_decodings import OwnDecodings
from .generation import DecodeSettings, decode_batch_size, generation_features, greedy_generate, prompt_lengths
from .resume import model_fingerprint
from .training_data import (TokenCache, build_token_cache, completion_token_positions, load_token_cache,
                            save_token_cache, shared_prefix, token_cache_key)


#: Prompts decoded again to check a base-decodings file before its decodings are used.
CHECKED_PROMPTS = 4


class RankWork:
    """Force-decoded features, greedy generations and the token cache of rows, each rank its part (gathered).

    The trainer calls :meth:`init_base_decodings` once."""

    def init_base_decodings(self) -> None:
        """``base_decodings``: the given file (``config.base_decodings``), else the decodings this run kept at the
        base head (:mod:`.own_decodings`; ``own_decodings`` keeps them, None when a file is given)."""
        c = self.config
        self.own_decodings = None
        if c.base_decodings:
            self.base_decodings = BaseDecodings(os.path.expanduser(c.base_decodings), self.tokenizer)
        else:
            settings = self.decode_settings()
            self.own_decodings = OwnDecodings(self.out, self.dp.rank, {
                "model": model_fingerprint(c.model),
                "settings": {k: getattr(settings, k) for k in REPLAY_SETTINGS}}, self.tokenizer)
            self.base_decodings = self.own_decodings.load()
        self._base_decodings_checked = self.own_decodings is not None  # its own decodings need no check

    def keep_base_decodings(self, decoded, settings: DecodeSettings) -> None:
        """Keep ``decoded`` with the run's own base decodings when ``settings`` kept their decision states (a pass at
        the base head of a run that keeps its own)."""
        if settings.keep_decisions and decoded:
            self.base_decodings = self.own_decodings.keep(decoded, settings.feature_parts, settings)

    def features_of(self, rows: Sequence[dict], desc: str,
                    feature_parts=_embed.DEFAULT_FEATURE_PARTS) -> np.ndarray:
        """Force-decoded verifier inputs of ``rows`` (the pooled ``feature_parts``); with several ranks each runs
        whole batches, gathered."""
        c = self.config
        prompts, completions = [r["prompt"] for r in rows], [r["completion"] for r in rows]
        parts, shared = [np.arange(len(rows))], None
        if self.dp.active:
            keys = _embed.prompt_completion_kept_lengths(self.tokenizer, prompts, completions,
                                                         delimiter=c.delimiter, max_length=c.max_length)
            parts = self.dp.aligned_parts(keys, c.embed_batch_size)
            # the whole set's shared prefix: every rank runs the prefix a single process would (same rows)
            seqs = [_embed.encode(self.tokenizer, p + q) for p, q in zip(prompts, completions)]
            shared = seqs[0][: _embed.common_prefix_length(seqs)] if seqs else None
        mine = parts[self.dp.rank]
        with Progress(len(mine), desc, unit="doc", enabled=c.verbose) as bar:
            feats = _embed.prompt_completion_features(
                self.model, self.tokenizer, [prompts[i] for i in mine], [completions[i] for i in mine],
                delimiter=c.delimiter, max_length=c.max_length,
                batch_size=c.embed_batch_size, on_missing="error", progress=bar.update, shared_prefix=shared,
                parts=feature_parts,
            ).embeddings if len(mine) else np.zeros((0, 0), dtype=np.float32)
        return self.dp.gather_parts(feats, parts)

    def generate(self, rows: Sequence[dict], desc: str, *, verifier=None, journal: DecodeJournal | None = None,
                 base_head: bool = False):
        """Greedy generations of ``rows`` with their features (those ``verifier`` was trained on, if given);
        ``base_head``: W_pos is still the base head's copy, so the given base decodings serve."""
        c, settings = self.config, self.decode_settings(verifier, keep_decisions=base_head)
        journal = (self.given_in_front(journal, settings) if base_head
                   else self.replayed_in_front(journal, settings, rows))
        with Progress(len(rows), desc, unit="doc", enabled=c.verbose) as bar:
            gens = greedy_generate(self.heads, self.tokenizer, [r["prompt"] for r in rows], settings, features=True,
                                   progress=bar.update, journal=journal)
        self.keep_base_decodings(gens, settings)
        return gens

    def given_in_front(self, journal: DecodeJournal | None, settings: DecodeSettings):
        """``journal`` with the base model's given decodings (``config.base_decodings``, :mod:`.base_decodings`) in
        the parts ``settings`` pools in front of it (:class:`~.decode_journal.GivenDecodings`), else ``journal``
        itself.  The first time, :data:`CHECKED_PROMPTS` of the file's prompts are decoded again and compared (a
        file of another model or setting is refused)."""
        base = self.base_decodings
        if base is None:
            return journal
        known = base.decodings(settings.feature_parts)
        if not self._base_decodings_checked:
            sample = list(known.values())[:CHECKED_PROMPTS]
            again = greedy_generate(self.heads, self.tokenizer, [d.prompt_ids for d in sample], settings,
                                    features=True)
            differ = base.check_against(again, sample)
            self._base_decodings_checked = True
            self.log(f"the base-head decodings of {len(known)} prompts are given by {base.path} ({len(sample)} "
                     f"decoded again, {differ} of them differently)")
        return GivenDecodings(known, journal)

    def replayed_in_front(self, journal: DecodeJournal | None, settings: DecodeSettings, rows: Sequence[dict]):
        """``journal`` with the base decodings of ``rows``' prompts that the current heads make again (replayed from
        their decision states, :meth:`~.base_decodings.BaseDecodings.replayed`) in front of it, else ``journal``
        itself: a pass after a W_pos step decodes only the prompts whose answer the step changed."""
        base = self.base_decodings
        if base is None or not base.replayable or not rows:
            return journal
        keys = {prompt_key(_embed.encode(self.tokenizer, r["prompt"])) for r in rows}
        known = base.replayed(self.heads, settings, keys=keys)
        self.log(f"{len(known)} of {len(keys)} prompts: the current W_pos picks the base decoding's every token "
                 f"(replayed from the decision states in {base.path}); the other {len(keys) - len(known)} are decoded")
        return GivenDecodings(known, journal) if known else journal

    def journal(self, purpose: str) -> DecodeJournal:
        """This rank's :class:`~.decode_journal.DecodeJournal` of one decoding pass (``purpose``, e.g.
        ``calibration-epoch2``), keyed by the current W_pos (its checksum), the verification layer, the base model
        and the decode settings."""
        c = self.config
        key = {"purpose": purpose, "head": weight_checksum(self.heads), "model": model_fingerprint(c.model),
               # the config's decode settings; the parts pooled follow from the verification layer (its manifest)
               "verifier": manifest_digest(self.verifier_path), "settings": strict(self.decode_settings()),
               "ranks": self.dp.size}
        return DecodeJournal(os.path.join(self.out, JOURNAL_DIR, f"{purpose}.rank{self.dp.rank}"), key)

    def discard_journals(self) -> None:
        """Delete this rank's journals (called once the state that makes them unneeded is saved)."""
        discard_journals(os.path.join(self.out, JOURNAL_DIR), self.dp.rank)

    def calibration_count(self, est, cal_rows: Sequence[dict], purpose: str, *, base_head: bool = False) -> dict:
        """(e) Generate over D_ca* and count admitted ŷ = 1 documents with a correct parsed task answer (this rank's
        part, journaled as ``purpose``; summed over the ranks); ``base_head`` as in :meth:`generate`."""
        c = self.config
        part = [cal_rows[i] for i in self.generation_parts(cal_rows)[self.dp.rank]]
        settings = self.decode_settings(est, keep_decisions=base_head)
        journal = own = self.journal(purpose)
        journal = (self.given_in_front(journal, settings) if base_head
                   else self.replayed_in_front(journal, settings, part))
        counts = count_verified(self.heads, self.tokenizer, est, part, self.completions, settings=settings,
                                verbose=c.verbose, journal=journal) if part else None
        if settings.keep_decisions:  # what this pass decoded is in its journal (also the part before a stop)
            self.keep_base_decodings(list(own.done().values()), settings)
        if not self.dp.active:
            return counts
        return sum_counts(self.dp, counts)

    def decode_settings(self, verifier=None, *, keep_decisions: bool = False) -> DecodeSettings:
        """How the run decodes (its generations and its calibration counts): the config's settings; with the
        ``verifier`` that will judge the generations, pooling the features it was trained on (DESIGN #21);
        ``keep_decisions`` (a pass at the base head): the decodings keep their decision states when the run keeps
        base decodings of its own (:mod:`.own_decodings`)."""
        c = self.config
        parts = verifier_parts(verifier) if verifier is not None else _embed.DEFAULT_FEATURE_PARTS
        return DecodeSettings(max_new_tokens=c.max_new_tokens, delimiter=c.delimiter, max_length=c.max_length,
                              batch_size=c.generation_batch_size, feature_parts=tuple(parts),
                              keep_decisions=keep_decisions and self.own_decodings is not None)

    def token_cache(self, pos_rows: Sequence[dict], *, store: str | None = None) -> TokenCache:
        """The token cache of the y = 1 training rows (with several ranks each runs whole batches; gathered).

        ``store``: a directory that keeps it across runs (:func:`~.training_data.save_token_cache`): a cache saved
        there from the same rows, model and settings is read instead of running the model again (every rank reads
        it); otherwise it is built and rank 0 saves it there.  The build keeps its finished parts in
        ``<store>.partial.rank<r>/`` (:func:`~.training_data.build_token_cache`'s journal), so a build stopped
        midway computes only the rest when the run is started again."""
        key = None
        if store is not None:
            key = token_cache_key(model_fingerprint(self.config.model), pos_rows, self.config.delimiter,
                                  self.config.max_length)
            saved = load_token_cache(store, key)
            self.dp.check_same(float(saved is not None), "whether a saved token cache was found")
            if saved is not None:
                self.log(f"reusing the token cache of {len(pos_rows)} y=1 training documents ({len(saved)} tokens) "
                         f"saved in {store}")
                return saved
        given = self._given_completion_states(pos_rows)
        journal = None if store is None else ChunkJournal(
            f"{store.rstrip(os.sep)}.partial.rank{self.dp.rank}",
            {**key, "rank": self.dp.rank, "ranks": self.dp.size,
             "given": [i for i, g in enumerate(given or ()) if g is not None]})
        cache = self._build_token_cache(pos_rows, journal, given)
        if store is not None and self.dp.writer:
            save_token_cache(store, cache, key)
        if journal is not None:
            journal.discard()  # the cache is whole (and saved by the writer): its parts are not needed again
        return cache

    def _given_completion_states(self, pos_rows: Sequence[dict]) -> list | None:
        """Per y = 1 row, the base decoding's decision states when its completion is the base model's own answer
        (:meth:`~.base_decodings.BaseDecodings.completion_states`); None without base decodings or with several
        ranks (each rank then runs its part, as before)."""
        base = self.base_decodings
        if base is None or not base.replayable or self.dp.active:
            return None
        given = [base.completion_states(r["prompt"], r["completion"]) for r in pos_rows]
        n = sum(g is not None for g in given)
        self.log(f"{n} of {len(pos_rows)} y=1 training documents are the base model's own decodings: their "
                 f"completion states are the decision states in {base.path}")
        return given

    def _build_token_cache(self, pos_rows: Sequence[dict], journal=None, given=None) -> TokenCache:
        c = self.config
        if not self.dp.active:
            return build_token_cache(self.heads, self.tokenizer, pos_rows, c, journal=journal, given=given)
        planned = [completion_token_positions(self.tokenizer, r["prompt"], r["completion"], c.delimiter,
                                              c.max_length) for r in pos_rows]
        need = [max(pos) + 1 if pos else 0 for _, pos, _ in planned]  # token_hidden_states' sort key
        mine = self.dp.aligned_parts(need, c.embed_batch_size)[self.dp.rank]
        prefix = shared_prefix([ids for ids, _, _ in planned], [pos for _, pos, _ in planned])  # on every rank
        cache = build_token_cache(self.heads, self.tokenizer, [pos_rows[i] for i in mine], c, prefix_ids=prefix,
                                  journal=journal)
        hidden = cache.hidden if len(cache) else np.zeros((0, self.heads.hidden_size), dtype=np.float32)
        hidden, targets = self.dp.gather_rows(hidden), self.dp.gather_rows(cache.targets)
        doc = self.dp.gather_rows(mine[cache.doc])  # global document index of every token
        order = np.argsort(doc, kind="stable")  # the single-process order: documents in row order
        return TokenCache(hidden=hidden[order], targets=targets[order], doc=doc[order], skipped=cache.skipped)

    def document_qd(self, est, rows: Sequence[dict], purpose: str, *,
                    base_head: bool = False) -> tuple[np.ndarray, np.ndarray, list]:
        """q, d of each row's greedy generation (no self-exclusion, training distance eCDFs).

        Each rank generates its contiguous part; q and d are gathered (``gens``: this rank's part);
        ``base_head`` as in :meth:`generate`.
        """
        parts = self.generation_parts(rows)
        part = [rows[i] for i in parts[self.dp.rank]]
        gens = self.generate(part, "generate (train q, d)", verifier=est, journal=self.journal(purpose),
                             base_head=base_head)
        q = d = np.zeros(0, dtype=np.float32)
        if part:
            q, d, _ = est.similarity_distance(generation_features(gens), distance_ecdfs="training")
        q, d = (self.dp.gather_parts(np.asarray(a, dtype=np.float32), parts) for a in (q, d))
        return q, d, gens

    def generation_parts(self, rows: Sequence[dict]) -> list:
        """Every rank's rows of a greedy generation over ``rows``, in whole single-process batches."""
        if not self.dp.active:
            return [np.arange(len(rows))]
        keys = prompt_lengths(self.tokenizer, [r["prompt"] for r in rows])
        return self.dp.aligned_parts(keys, decode_batch_size(self.heads, self.config.generation_batch_size))
