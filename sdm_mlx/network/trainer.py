"""SDM-network training, Alg. 4 (``alg:sdm-network-training``) with a frozen trunk (DESIGN #17-21).

Steps (DESIGN #17-21 fix what the paper leaves open):

(a) **Verification layer, once.**  Task rows ``(id, label = y_task, document)`` become verification rows
    (``sdm_mlx.llm.verification_data``: each row is a positive with its own label's completion, or a constructed
    negative with another label's).  Their force-decoded features (``sdm_mlx.llm.embed``: concat(mean of final-norm
    states, state predicting the closing delimiter)) train an ``SDMEstimator`` (J rounds over pooled re-splits).
    The split of its selected round is D_tr* (support set) / D_ca* (calibration) for everything below.  θ is frozen,
    so Alg. 4 line 11 (retraining the verifier) is skipped (DESIGN #19).
(b) **Token cache, once.**  For every y = 1 row of D_tr*: the frozen hidden states at the positions predicting each
    completion token up to and including the closing-delimiter token (at most ``max_length`` positions), with
    targets ``token + |V|``.
(c) **q, d before every epoch.**  Greedy joint decoding of the y = 1 training prompts with the current heads; the
    verifier's q and d of each generated output (support search without self-exclusion, *training* distance eCDFs)
    are given to every token of that document.
(d) **One epoch of W_pos**: Adam (bias-corrected; lr 1e-5 default), tokens shuffled at token level (seeded),
    mini-batches of ``batch_size`` tokens, β rising linearly per mini-batch from β_min to β_max (reset every epoch),
    loss of ``eq:sdm-network-next-token-training-loss`` (:mod:`.loss`); a compiled step and one ``mx.eval`` per
    step.
(e) **Selection (DESIGN #20).**  Before training and after every epoch, greedy decoding over all D_ca* prompts;
    count the documents admitted by p̂_lower with verification prediction 1 AND a correct task answer parsed from
    the generated JSON (parse failures are wrong).  An epoch is kept only if its count is STRICTLY greater than the
    best so far (initially: the count before fine-tuning, for which the saved network is the base head itself).

Outputs under ``output_dir``: ``verifier/`` (the verification layer), ``network/`` (the selected network,
:mod:`.artifact`), ``metrics.json`` (updated after every epoch), ``verification_rows.jsonl`` (the rows with their
split) and ``resume/`` (what continuing needs: after an epoch's training and after its count, :mod:`.resume`).
Progress goes to stderr.

What is left here is Alg. 4's sequence; each step's work lives elsewhere: :mod:`.step` and :mod:`.loss` the W_pos
step, :mod:`.rank_work` the embedding and decoding over the ranks, :mod:`.selection` the count of (e).
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..llm import embed as _embed
from ..llm.pooling import verifier_parts
from ..storage.artifact import prepare_run_directory
from ..storage.datasets import id_key
from ..storage.files import strict, write_json, write_jsonl
from ..runtime.callbacks import log, progress_bar as Progress
from .config import NetworkConfig
from .artifact import base_model_reference, mark_network_finished, read_network_config, save_network
from .data_parallel import DataParallel, make_dp_train_step, weight_checksum
from .rank_work import RankWork
from .resume import PARTIAL_EPOCH, TRAINED_EPOCH, Resumption, discard_state, pending_note
from .selection import VerifierAdmitsNothing, head_label, select_improved
from .step import EpochInputs, EpochTokens, MiniBatches, make_optimizer, make_step, make_train_step, train_epoch
from .training_data import (TokenCache, build_verification_rows, completion_token_positions,  # noqa: F401 (re-exported)
                            TOKEN_CACHE_DIR, corrected_rows, model_answer_rows)
from .generation import generation_features
from .heads import SDMHeads
from ..errors import InputError


@dataclass
class NetworkTrainResult:
    """What :func:`train_network` produced."""

    network_path: str
    verifier_path: str
    metrics_path: str
    selected_epoch: int  #: 0 = the base head (no epoch beat the initial count)
    best_count: int
    initial_count: int
    history: list


class SDMNetworkTrainer(RankWork):
    """Alg. 4 with a frozen trunk; see the module docstring.  ``run()`` does everything.

    Under ``mlx.launch`` the work is split over the ranks of ``dp`` and rank 0 alone reports and writes the
    run directory.

    Parameters
    ----------
    config : NetworkConfig
        The ``network-train`` settings (:mod:`sdm_mlx.network.config`); validated here.
    model, tokenizer : optional
        An already loaded mlx-lm model and its tokenizer instead of loading ``config.model``.
    estimator_factory : callable, optional
        ``estimator_factory(**params)`` builds the verification layer (default
        :class:`sdm_mlx.estimator.SDMEstimator`).
    dp : DataParallel, optional
        The ranks to split the work over (default: ``mx.distributed.init()``; :mod:`.data_parallel`).

    Attributes
    ----------
    config : NetworkConfig
        The settings in force (progress off on every rank but 0).
    dp : DataParallel
        The ranks; ``dp.writer`` is rank 0.
    model, tokenizer :
        The frozen trunk's language model and its tokenizer.
    heads : SDMHeads
        The frozen reference/negative head and the trained float32 ``W_pos`` (DESIGN #19).
    """

    def __init__(self, config: NetworkConfig, model=None, tokenizer=None, estimator_factory=None,
                 dp: DataParallel | None = None):
        config.validate()
        self.dp = dp if dp is not None else DataParallel(timeout=config.distributed_timeout)
        if not self.dp.writer:
            config = dataclasses.replace(config, verbose=False)  # rank 0 alone shows progress
        self.config = config
        self.out = os.path.abspath(config.output_dir)
        self.resumption = Resumption(config, self.dp.size, self.dp.writer, self.out)  # (resume.py)
        self.dp.check_same(self.resumption.stage, "the network-train state in --output (rank 0 writes it, every rank "
                           "reads it: one shared file system)")
        if self.dp.writer:
            prepare_run_directory(config.output_dir, "network-train", self._may_replace(), config.input_paths(),
                                  "--output", check_only=True)
        if model is None:
            model, tokenizer = _embed.load_model(config.model)
        elif tokenizer is None:
            raise InputError("pass the tokenizer together with the model")
        self.model, self.tokenizer = model, tokenizer
        self.heads = SDMHeads(model, reference_head=config.reference_head)
        if estimator_factory is None:
            from ..estimator import SDMEstimator

            estimator_factory = SDMEstimator
        self.estimator_factory = estimator_factory
        self.completions = config.resolved_completions()
        self.init_base_decodings()  # the base model's decodings, given or kept by this run (RankWork)
        self.network_path = os.path.join(self.out, "network")
        self.verifier_path = os.path.join(self.out, "verifier")
        self.metrics_path = os.path.join(self.out, "metrics.json")
        self.rng = np.random.default_rng(config.seed)

    # -- helpers --------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        log(f"network-train: {msg}", enabled=self.config.verbose)

    def _may_replace(self) -> bool:
        """The run directory's outputs may be replaced: --overwrite, --restart, or continuing its own state."""
        c = self.config
        return bool(c.overwrite or c.restart or self.resumption.state is not None)

    def write_metrics(self, metrics: dict) -> None:
        if self.dp.writer:
            write_json(self.metrics_path, metrics)

    # -- (a) -------------------------------------------------------------------------------------
    def model_answers(self, rows: Sequence[dict]) -> tuple[list, np.ndarray]:
        """``answers: model``: the base model's greedy answer to every prompt (W_pos still equals the head, so joint
        decoding is the model's own greedy decoding) becomes the row's completion, labelled by its parsed task
        answer; the features are those of that decoding, i.e. what verified generation computes."""
        gens = self.generate(rows, "model answers", base_head=True)
        out = model_answer_rows(rows, [g.text for g in gens], self.completions)
        forms = {k: sum(r["form"] == k for r in out) for k in ("compact", "fenced", "other", "unparsable")}
        self.answer_stats = {"mode": "model", "forms": forms, "correct": int(sum(r["label"] for r in out)),
                             "rows": len(out)}
        self.log(f"the model's own answers: {self.answer_stats['correct']} of {len(out)} right; forms {forms}")
        return out, generation_features(gens)

    def fit_verifier(self, rows: Sequence[dict], X: np.ndarray | None = None):
        """Train (or load) the verification layer; returns (estimator, train_rows, cal_rows)."""
        c = self.config
        if c.verifier:
            # a trained verifier needs no features of the rows: one row checks the width (on a 1.5B model on
            # CPU, embedding every row again costs ~3 s per row)
            from ..estimator import SDMEstimator

            est = SDMEstimator.load(c.verifier)
            parts = verifier_parts(est)  # the parts it was trained on
            width = self.features_of(rows[:1], "verifier width check", parts).shape[1]
            if est.input_dim_ != width:
                raise InputError(f"verifier {c.verifier} expects {est.input_dim_}-dim features, this model gives "
                                 f"{width} ({','.join(parts)})")
            self.log(f"reusing the verification layer at {c.verifier}")
        else:
            X = self.features_of(rows, "verifier features") if X is None else X
            ids = [r["id"] for r in rows]
            y = np.array([int(r["label"]) for r in rows], dtype=np.int64)
            self.log(f"training the verification layer on {len(rows)} force-decoded rows "
                     f"({int(y.sum())} with label 1), J = {c.verifier_iterations}")
            est = self.estimator_factory(**c.estimator_params())
            # labels are the binary verification indices; the features are DESIGN #21's parts, recorded
            est.fit(X, y, ids_train=ids, num_classes=2, feature_parts=_embed.DEFAULT_FEATURE_PARTS)
        if self.dp.active:  # every rank fitted (or loaded) the same estimator: check it
            self.dp.check_same(zlib.crc32("\n".join(map(str, est.support_ids_)).encode()), "the verifier's split")
            self.dp.check_same(float(np.sum(est.support_vectors_, dtype=np.float64)), "the verifier's support set")
        by_key = {id_key(r["id"]): r for r in rows}
        try:
            train_rows = [by_key[id_key(i)] for i in est.support_ids_]
            cal_rows = [by_key[id_key(i)] for i in est.calibration_ids_]
        except KeyError as e:
            raise InputError(f"the verification layer's split names id {e.args[0]} that is not in the data "
                             "(was it trained on other data?)") from None
        return est, train_rows, cal_rows

    # -- everything ------------------------------------------------------------------------------
    def save(self, est_path: str, epoch: int, count: int, epochs_completed: int) -> None:
        """Write the network holding the head of ``epoch`` (0 = the base head), marked as not finished."""
        if not self.dp.writer:
            return
        save_network(self.network_path, self.heads, self.config.model, est_path,
                     settings=self.config.network_settings(),
                     training={"epoch": epoch, "calibration_count": count, "head": head_label(epoch),
                               "finished": False, "epochs_completed": epochs_completed,
                               "epochs_planned": self.config.epochs,
                               "learning_rate": self.config.learning_rate, "beta_min": self.config.beta_min,
                               "beta_max": self.config.beta_max, "batch_size": self.config.batch_size,
                               "seed": self.config.seed}, overwrite=True)

    def interrupted(self, metrics: dict, epoch: int, selected: int, best: int) -> None:
        """Ctrl-C during ``epoch``: record it in the metrics and say what the network on disk holds."""
        metrics.update(finished=False, interrupted_during_epoch=epoch, epochs_completed=epoch - 1)
        if not self.dp.writer:
            return
        write_json(self.metrics_path, metrics)
        log(f"interrupted during epoch {epoch}/{self.config.epochs}: the network at {self.network_path} holds "
            f"{head_label(selected)} (calibration count {best}; best of the {epoch - 1} finished epoch(s)), marked "
            "finished=false in its network_config.json; run the same command again to resume after epoch "
            f"{epoch - 1} (--restart starts over)", True)

    def run_epoch(self, epoch: int, run: EpochInputs, *, metrics: dict, best: int, selected: int) -> tuple[int, int]:
        """(d) one epoch of W_pos, then (e) the calibration count; saves the head if it improved.

        The trained W_pos is saved before its count (a decoding pass of the whole calibration split: hours of a
        real model on a CPU), so a run stopped during the count resumes with the count, its decode journal intact
        (keyed by the head's checksum), instead of training the epoch again."""
        c, est, cal_rows, optimizer = self.config, run.est, run.cal_rows, run.optimizer
        row = metrics.pop(TRAINED_EPOCH, None)  # a resumed run: W_pos, Adam and the shuffle are that epoch's end
        if row is None or row.get("epoch") != epoch:
            row = self._train_epoch(epoch, run, metrics=metrics, best=best, selected=selected)
        t_count = time.perf_counter()
        cal = self.calibration_count(est, cal_rows, f"calibration-epoch{epoch}")
        improved = select_improved(cal["count"], best)
        if improved:
            best, selected = cal["count"], epoch
            self.save(self.verifier_path, selected, best, epoch)
        row = {**row, "calibration": cal, "count": cal["count"], "selected": improved,
               "epoch_seconds": row["train_seconds"] + time.perf_counter() - t_count}
        metrics["epochs"].append(row)
        metrics["selected_epoch"], metrics["best_count"] = selected, best
        self.write_metrics(metrics)
        self.resumption.save(self.heads, self.rng, optimizer, epochs_completed=epoch, best=best, selected=selected,
                             metrics=metrics)
        self.discard_journals()
        self.log(
            f"epoch {epoch}/{c.epochs}: loss {row['loss']:.4f} (L {row['nll']:.4f}, R {row['reg']:.4f}, "
            f"R' {row['reg_rescaled']:.4f}), beta {row['beta_first']:.4g}->{row['beta_last']:.4g}, "
            f"count {cal['count']} (best {best}{', kept' if improved else ''}), "
            f"{row['tokens_per_s']:.0f} tok/s, {row['epoch_seconds']:.1f}s"
        )
        return best, selected

    def _train_epoch(self, epoch: int, run: EpochInputs, *, metrics: dict, best: int, selected: int) -> dict:
        """(c) the q, d of the y = 1 training documents, (d) W_pos's epoch over the token cache; saves the trained
        state (epochs finished: ``epoch`` − 1, this epoch's row pending its count) and returns the epoch's row."""
        c, (est, pos_rows, _, cache, hidden, targets, step, optimizer) = self.config, run
        t0, partial = time.perf_counter(), metrics.pop(PARTIAL_EPOCH, None)
        partial = partial if partial and partial.get("epoch") == epoch else None  # saved in this epoch's middle
        if partial is None:  # epoch 1 decodes before its first step: with the base head (W_pos a copy of it)
            q_doc, d_doc, _ = self.document_qd(est, pos_rows, f"train-qd-epoch{epoch}", base_head=epoch == 1)
        else:  # the epoch's q, d of its first step (W_pos has moved since)
            q_doc, d_doc = (np.asarray(partial[k], dtype=np.float32) for k in ("q", "d"))
        t_qd = partial["qd_seconds"] if partial else time.perf_counter() - t0
        q_tok, d_tok = q_doc[cache.doc], d_doc[cache.doc]
        order = self.resumption.epoch_order(self.heads, self.rng, optimizer, epoch=epoch, partial=partial, saved={
            "metrics": metrics, "best": best, "selected": selected, "qd": {"q": q_doc, "d": d_doc, "seconds": t_qd}})
        with Progress(len(cache), f"epoch {epoch}/{c.epochs}", unit="tok", enabled=c.verbose) as bar:
            m = train_epoch(step, self.heads, optimizer, EpochTokens(hidden, targets, q_tok, d_tok),
                            MiniBatches(c.batch_size, c.beta_min, c.beta_max), order=order, progress=bar.update,
                            dp=self.dp)
        self.dp.check_same(weight_checksum(self.heads), f"W_pos after epoch {epoch}")
        row = {"epoch": epoch, **m, "q_mean": float(q_doc.mean()) if len(q_doc) else None,
               "d_mean": float(d_doc.mean()) if len(d_doc) else None, "qd_seconds": t_qd,
               "train_seconds": time.perf_counter() - t0}
        self.resumption.save(self.heads, self.rng, optimizer, epochs_completed=epoch - 1, best=best,
                             selected=selected, metrics={**metrics, TRAINED_EPOCH: row})
        return row

    def run(self) -> NetworkTrainResult:
        """Alg. 4 (``alg:sdm-network-training``): verifier once, then token epochs kept by DESIGN #20; continues
        from the run directory's saved state when there is one (:mod:`.resume`)."""
        c, state = self.config, self.resumption.state
        if state is not None and state.epochs_completed == c.epochs:
            return self._already_finished(state)
        if self.dp.writer:
            prepare_run_directory(self.out, "network-train", self._may_replace(), c.input_paths(), "--output")
            if state is None:
                discard_state(self.resumption.path)  # --restart, or --overwrite of a run with other settings
        t_start = time.perf_counter()
        est, train_rows, cal_rows, pos_rows = self._split(state)
        cache, hidden, targets = self._device_cache(pos_rows)
        optimizer = make_optimizer(c.learning_rate)
        if state is None or state.epochs_completed is None:
            metrics = self._start_metrics(train_rows, cal_rows, pos_rows, len(cache))
            best, selected, done = self._initial_count(est, cal_rows, metrics)["count"], 0, 0
            self.resumption.save(self.heads, self.rng, optimizer, epochs_completed=0, best=best, metrics=metrics)
            self.discard_journals()
        else:
            metrics, best, selected, done = self.resumption.restore(self.heads, self.rng, optimizer, self.network_path)
            log(f"network-train: resuming after epoch {done} of {c.epochs} (kept: {head_label(selected)}, "
                f"count {best}); the verification layer and the finished epochs are not run again"
                f"{pending_note(metrics, done)}", self.dp.writer)
        if self.dp.active:
            step = make_dp_train_step(self.heads, optimizer, self.dp, compile=c.compile_step)
        else:
            step = make_step(self.heads, optimizer, kind=c.train_step, compile=c.compile_step)
        epoch, run = done, EpochInputs(est, pos_rows, cal_rows, cache, hidden, targets, step, optimizer)
        try:
            for epoch in range(done + 1, c.epochs + 1):
                best, selected = self.run_epoch(epoch, run, metrics=metrics, best=best, selected=selected)
        except KeyboardInterrupt:
            self.interrupted(metrics, epoch, selected, best)
            raise
        return self._finish(metrics, t_start, metrics["initial"]["count"], best, selected)

    def _split(self, state):
        """(a) once: the verification layer and Alg. 4's fixed split (est, train, calibration and y = 1 training
        rows); from a saved state, the saved ones (the verifier is loaded, not fitted again)."""
        c = self.config
        if state is not None:
            if state.epochs_completed is None:
                log("network-train: resuming after the verification layer's fit (not fitted again)", self.dp.writer)
            return self.resumption.load_split(self.verifier_path)
        rows, X = build_verification_rows(c, self.tokenizer), None
        if c.answers == "model" and not c.verification_data:
            rows, X = self.model_answers(rows)
        est, train_rows, cal_rows = self.fit_verifier(rows, X)
        self._write_verifier(est, rows, train_rows, cal_rows)
        self._check_admission(est, train_rows, cal_rows)
        pos_rows = [r for r in train_rows if int(r["label"]) == 1]
        if c.answers == "model":  # wrong own answers (rows with an answer_label), corrected in their own layout
            fixed = corrected_rows(train_rows, self.completions)
            if c.verification_data:  # given own-answer rows (e.g. a verified-generation run's answers)
                self.answer_stats = {"mode": "given", "rows": len(rows),
                                     "own_answer_rows": sum("answer_label" in r for r in rows)}
            self.answer_stats["corrected_positives"] = len(fixed)
            pos_rows += fixed
        self.log(f"split: {len(train_rows)} training rows ({len(pos_rows)} with label 1), "
                 f"{len(cal_rows)} calibration rows")
        self.resumption.record_split(train_rows, cal_rows, pos_rows, self.verifier_path,
                                     getattr(self, "answer_stats", None))
        self.resumption.save(self.heads, self.rng, None, epochs_completed=None)
        return est, train_rows, cal_rows, pos_rows

    def _already_finished(self, state) -> NetworkTrainResult:
        """The run directory holds a run that finished ``--epochs`` epochs: nothing to train (the network and
        metrics are marked finished if a kill came between the last epoch and that mark)."""
        c, metrics = self.config, state.metrics
        if self.dp.writer:
            if not read_network_config(self.network_path).get("training", {}).get("finished", False):
                mark_network_finished(self.network_path, c.epochs)
                self.write_metrics(dict(metrics, finished=True, epochs_completed=c.epochs))
            log(f"network-train: --output {c.output_dir} holds a finished run ({c.epochs} of {c.epochs} epochs; "
                f"kept: {head_label(state.selected)}, count {state.best}): nothing to do (raise --epochs to train "
                "on from the last epoch, --restart to start over)", True)
        return NetworkTrainResult(network_path=self.network_path, verifier_path=self.verifier_path,
                                  metrics_path=self.metrics_path, selected_epoch=state.selected,
                                  best_count=state.best, initial_count=metrics["initial"]["count"],
                                  history=metrics["epochs"])

    def _write_verifier(self, est, rows, train_rows, cal_rows) -> None:
        """(a)'s outputs (rank 0): ``verifier/`` and ``verification_rows.jsonl`` with every row's split."""
        if not self.dp.writer:
            return
        est.save(self.verifier_path, overwrite=True)  # inside our own run directory (checked in run)
        split = {id_key(r["id"]): "train" for r in train_rows}
        split.update({id_key(r["id"]): "calibration" for r in cal_rows})
        write_jsonl(os.path.join(self.out, "verification_rows.jsonl"),
                    [{**r, "split": split.get(id_key(r["id"]), "unused")} for r in rows])

    def _check_admission(self, est, train_rows, cal_rows) -> None:
        """Stop before the token epochs when the verification layer admits no calibration row (its diagnosis,
        :mod:`sdm_mlx.calibration.diagnosis`): every count of (e) would be 0, so no epoch could ever be selected."""
        c = self.config
        diag = getattr(est, "admission_", None)
        if not c.require_admission or c.epochs == 0 or diag is None or diag["can_admit"]:
            return
        self.write_metrics({"config": strict(c), "train_rows": len(train_rows), "calibration_rows": len(cal_rows),
                            "finished": False, "stopped": "verifier_admits_nothing", "verifier_diagnosis": diag,
                            "epochs": []})
        raise VerifierAdmitsNothing.of(diag, c.epochs, self.verifier_path)

    def _device_cache(self, pos_rows) -> tuple[TokenCache, mx.array, mx.array]:
        """(b) the token cache with its hidden states and targets on the device (the host copy is dropped)."""
        c = self.config
        cache = self.token_cache(pos_rows, store=os.path.join(self.out, TOKEN_CACHE_DIR))
        self.log(f"cached {len(cache)} completion tokens of {len(pos_rows)} y=1 training documents "
                 f"(hidden {self.heads.hidden_size}, |V| = {self.heads.vocab_size})")
        if len(cache) == 0 and c.epochs > 0:
            raise InputError("no training tokens: every y=1 training completion lies beyond max_length "
                             f"{c.max_length} (raise max_length or shorten the prompts)")
        hidden = mx.array(cache.hidden) if len(cache) else mx.zeros((0, self.heads.hidden_size))
        cache.hidden = None  # the device copy is the one used from here on
        return cache, hidden, mx.array(cache.targets.astype(np.int32))

    def _start_metrics(self, train_rows, cal_rows, pos_rows, tokens: int) -> dict:
        """The run's ``metrics.json`` before any count: config, sizes, data-parallel layout."""
        c = self.config
        metrics = {"config": strict(c), "base_model": base_model_reference(c.model),
                   "vocab_size": self.heads.vocab_size, "hidden_size": self.heads.hidden_size,
                   "train_rows": len(train_rows), "calibration_rows": len(cal_rows),
                   "train_positive_rows": len(pos_rows), "tokens": tokens, "epochs": []}
        if self.dp.active:
            metrics["data_parallel"] = {"ranks": self.dp.size, "split": "whole batches", "gradient_exchange": "auto"}
        metrics["answers"] = getattr(self, "answer_stats", {"mode": "preset" if not c.verification_data else "given"})
        return metrics

    def _initial_count(self, est, cal_rows, metrics: dict) -> dict:
        """(e) before fine-tuning: the count of the base head, saved as epoch 0 — the bar to beat."""
        initial = self.calibration_count(est, cal_rows, "calibration-epoch0", base_head=True)
        best = initial["count"]
        self.save(self.verifier_path, 0, best, 0)
        metrics["initial"] = initial
        metrics["selected_epoch"], metrics["best_count"] = 0, best
        self.write_metrics(metrics)
        self.log(f"initial calibration count {best} (admitted with prediction 1: {initial['admitted_pred1']}, "
                 f"task-correct: {initial['task_correct']} of {initial['documents']}) — the bar to beat")
        return initial

    def _finish(self, metrics: dict, t_start: float, initial: int, best: int, selected: int) -> NetworkTrainResult:
        """Mark the network finished, write the final metrics and return the run's result."""
        c = self.config
        if self.dp.writer:
            mark_network_finished(self.network_path, c.epochs)
        metrics.update(finished=True, epochs_completed=c.epochs)
        metrics["total_seconds"] = time.perf_counter() - t_start
        self.write_metrics(metrics)
        self.log(f"selected epoch {selected} (count {best}; initial {initial}); network at {self.network_path}")
        return NetworkTrainResult(network_path=self.network_path, verifier_path=self.verifier_path,
                                  metrics_path=self.metrics_path, selected_epoch=selected, best_count=best,
                                  initial_count=initial, history=metrics["epochs"])


def train_network(config: NetworkConfig, model=None, tokenizer=None, estimator_factory=None,
                  dp: DataParallel | None = None) -> NetworkTrainResult:
    """Run Alg. 4 (see the module docstring); returns paths, the selected epoch and per-epoch metrics.

    Under ``mlx.launch`` the ranks split the work (:mod:`.data_parallel`); rank 0 writes the outputs.
    """
    return SDMNetworkTrainer(config, model, tokenizer, estimator_factory, dp).run()
