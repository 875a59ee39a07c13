"""Settings of SDM-network training (Alg. 4, :func:`sdm_mlx.network.train_network`) in one dataclass.

Each field carries its default and help text (:func:`sdm_mlx.settings.option`); ``sdm-mlx network-train``
options and YAML recipe keys are generated from it.  The verification layer's defaults are the
estimator's (:class:`sdm_mlx.estimator.config.EstimatorConfig`).  No MLX import here, so ``--help`` stays fast.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..llm import embed as _embed
from ..estimator.config import DISTRIBUTED_TIMEOUT, TIMEOUT_HELP, EstimatorConfig
from ..settings import option
from ..llm.verification_data import PAPER_SYSTEM, PRESETS
from ..errors import InputError

_E = EstimatorConfig()


@dataclass
class NetworkConfig:
    """Settings of :func:`train_network` (paper defaults where the paper has one)."""

    # model and data
    model: str = option("", "base model: mlx-lm directory or hub id (e.g. mlx-community/Phi-3.5-mini-instruct-4bit)",
                        short="-m", required=True)
    output_dir: str = option("", "output directory (new or empty; an earlier network-train run's directory only "
                                 "with --overwrite; a run interrupted there continues after its last finished "
                                 "epoch with the same command)", flag="--output", required=True)
    data: str | None = option(None, "task JSONL with id, label (task label 0..C-1), document")
    verification_data: str | None = option(
        None, "instead of --data: verification rows JSONL (id, prompt, completion, label, [task_label]), e.g. from "
              "make-verification-data; rows of the model's own answers also carry answer_label (its parsed "
              "answer), and with --answers model its wrong ones, corrected, become W_pos positives")
    tasks: list | None = option(
        None, "instead of --data: several tasks trained together (universal verification), a YAML list of mappings "
              "{name, data, preset | completions + prompt_template}; row ids become '<name>/<id>'. With "
              "verification_data the mappings have no data: they give each task's completions, looked up by the "
              "rows' 'task' field", cli=False)
    completions: list[str] | None = option(
        None, "one completion per task label, in label order", none_means="the --preset's")
    preset: str | None = option(None, "the paper's completions and instruction", choices=tuple(sorted(PRESETS)))
    system: str | None = option(PAPER_SYSTEM, "system message ('' for none)", aliases=("--system-prompt",))
    prompt_template: str | None = option(None, "user message with a {document} slot", none_means="the preset's")
    use_chat_template: bool = option(True, "wrap prompts in the tokenizer's chat template (off: raw text prompts "
                                           "for base models without one)")
    delimiter: str = option(_embed.DEFAULT_DELIMITER, "closing delimiter of the answer")
    max_length: int = option(_embed.DEFAULT_MAX_LENGTH, "token positions kept for features and targets")
    negatives_seed: int = option(0, "seed of the constructed-negative assignment")
    answers: str = option(
        "model", "completions of the verification rows built from --data/--tasks: 'model' = the model's own greedy "
                  "answers (label 1 = the parsed answer is right; the form the model writes at generation time; wrong "
                  "answers, corrected in the model's layout, become W_pos positives), 'preset' = the completions "
                  "force-decoded with constructed negatives (the paper's encoding)", choices=("model", "preset"))
    # next-token training of W_pos
    epochs: int = option(5, "epochs of W_pos training (raised for a finished run in --output: it trains on from "
                            "its last epoch)")
    beta_min: float = option(0.0, "β at the first mini-batch of every epoch")
    beta_max: float = option(0.1, "β approached at the end of every epoch")
    learning_rate: float = option(1e-5, "Adam learning rate for W_pos")
    batch_size: int = option(50, "tokens per mini-batch")
    max_new_tokens: int = option(32, "greedy decoding limit")
    generation_batch_size: int = option(64, "prompts decoded together (continuous batching; every decode step "
                                            "reads the weights once for the whole batch)")
    embed_batch_size: int = option(8, "documents per forward pass for features")
    checkpoint_minutes: float = option(10.0, "save the training state this often in the middle of an epoch of "
                                             "W_pos, so a stopped run goes on from there (0: only between epochs)")
    train_step: str = option(
        "auto", "where the W_pos step runs: 'host' (NumPy + BLAS, the loss gradient in closed form, Adam in "
                "vocabulary row blocks: 7x MLX's on a Linux CPU for Qwen2.5-1.5B's head), 'mlx' (MLX ops: for "
                "Apple silicon's GPU), 'auto' (host when MLX runs on the CPU, one process and a float32 "
                "reference head)", choices=("auto", "host", "mlx"))
    compile_step: bool = option(True, "mx.compile the MLX training step (MLX's fused CPU kernels were slower for "
                                      "Phi-3.5-sized heads on a Linux CPU; keep it on on Apple silicon)")
    reference_head: str = option(
        "model", "z_ref = z_neg from the model's own (possibly quantised) head, or from a frozen float32 copy "
                 "(+|V|*D*4 bytes; much faster on Linux CPUs for quantised models)", choices=("model", "float32"))
    # verification layer (defaults: the estimator's; verifier_options may set e.g. "patience")
    verifier: str | None = option(None, "reuse an already trained verification layer (directory)")
    base_decodings: str | None = option(
        None, "an .npz of the base model's greedy decodings of the rows' prompts (prompts, texts, features, "
              "feature_parts; sdm-mlx pipeline writes it from its answers stage): the passes that decode with the "
              "base head (the count before fine-tuning, epoch 1's q, d, --answers model) take these prompts' "
              "decodings from it instead of decoding them again (a few are decoded again to check the file)")
    alpha: float = option(_E.alpha, "target conditional accuracy α' of the verification layer")
    verifier_iterations: int = option(_E.iterations, "J of the verification layer")
    verifier_epochs: int = option(_E.epochs, f"epochs per round of the verification layer (a cap: rounds stop "
                                             f"after {_E.patience} epochs without a better balanced median q)")
    verifier_exemplar_dim: int = option(_E.exemplar_dim, "M of the verification layer")
    verifier_batch_size: int = option(_E.batch_size, "Adam batch size of the verification layer")
    verifier_learning_rate: float = option(_E.learning_rate, "Adam learning rate of the verification layer")
    verifier_rescaler_max_epochs: int = option(_E.rescaler_max_epochs, "Alg. 2 epochs of the verification layer")
    verifier_normalize: str = option("per-dimension", "input normalisation of the verification layer (DESIGN #2: "
                                                      "per-dimension for LLM hidden states)",
                                     choices=("scalar", "per-dimension", "none"))
    require_admission: bool = option(True, "stop before the epochs, with the verification layer's diagnosis, when it "
                                           "admits no calibration row: Alg. 4's count would stay 0 and no epoch "
                                           "could be selected (--no-require-admission: run the epochs anyway)")
    verifier_options: dict = option({}, "any other SDMEstimator keyword for the verification layer (YAML only)",
                                    cli=False)
    seed: int = option(0, "random seed")
    distributed_timeout: float = option(DISTRIBUTED_TIMEOUT, "under mlx.launch: " + TIMEOUT_HELP)
    verbose: bool = option(False, "progress on stderr (the CLI turns it on; --quiet off)", cli=False)
    overwrite: bool = option(False, "replace the outputs of an earlier network-train run in --output (a directory "
                                    "that sdm-mlx did not create is never written into); a run with the "
                                    "same settings is continued, one with other settings started over")
    restart: bool = option(False, "discard the state a run saved in --output after its last finished epoch and "
                                  "start over (without it, the same command continues an interrupted run after "
                                  "its last finished epoch, and says when there is nothing left to do)")

    def validate(self) -> None:
        if not self.model:
            raise InputError("a base model (path or hub id) is required")
        if not self.output_dir:
            raise InputError("an output directory is required")
        completions_only = self.verification_data is not None and self.tasks is not None  # tasks name completions
        inputs = (self.data, self.verification_data, None if completions_only else self.tasks)
        if sum(x is not None for x in inputs) != 1:
            raise InputError("give exactly one of data (task JSONL), verification_data (verification rows JSONL) "
                             "and tasks (several task JSONLs)")
        if self.tasks is not None:
            if not isinstance(self.tasks, list) or not self.tasks:
                raise InputError("tasks must be a non-empty list of mappings (name, data, preset | completions)")
            names = set()
            for i, t in enumerate(self.tasks):
                if not isinstance(t, dict) or "name" not in t or ("data" not in t and not completions_only):
                    raise InputError(f"tasks[{i}] must be a mapping with at least 'name' and 'data'")
                if completions_only and "data" in t:
                    raise InputError(f"tasks[{i}]: with verification_data the tasks only name completions (the "
                                     "rows come from verification_data): remove 'data'")
                unknown = set(t) - {"name", "data", "preset", "completions", "prompt_template"}
                if unknown:
                    raise InputError(f"tasks[{i}] has unknown key(s) {sorted(unknown)}")
                if t["name"] in names:
                    raise InputError(f"task name {t['name']!r} repeats")
                names.add(t["name"])
                if t.get("preset") is not None and t["preset"] not in PRESETS:
                    raise InputError(f"tasks[{i}]: unknown preset {t['preset']!r}")
                if not t.get("completions") and not t.get("preset"):
                    raise InputError(f"tasks[{i}] needs completions or a preset")
        for name in ("epochs",):
            if int(getattr(self, name)) < 0:
                raise InputError(f"{name} must be >= 0")
        for name in ("batch_size", "max_new_tokens", "generation_batch_size", "embed_batch_size", "max_length",
                     "verifier_iterations", "verifier_epochs", "verifier_exemplar_dim", "verifier_batch_size",
                     "verifier_rescaler_max_epochs"):
            if int(getattr(self, name)) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.learning_rate > 0:
            raise InputError(f"learning_rate must be > 0, got {self.learning_rate}")
        if isinstance(self.distributed_timeout, bool) or not (isinstance(self.distributed_timeout, (int, float))
                                                                and self.distributed_timeout > 0):
            raise InputError(f"distributed_timeout must be a number of seconds > 0, got {self.distributed_timeout!r}")
        if self.beta_min < 0 or self.beta_max < 0:
            raise InputError("beta_min and beta_max must be >= 0")
        minutes = self.checkpoint_minutes
        if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not math.isfinite(minutes) or minutes < 0:
            raise InputError(f"checkpoint_minutes must be a number of minutes >= 0 (0: save only between epochs), "
                             f"got {minutes!r}")
        if self.preset is not None and self.preset not in PRESETS:
            raise InputError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if self.base_decodings is not None and not os.path.isfile(os.path.expanduser(str(self.base_decodings))):
            raise InputError(f"base_decodings {self.base_decodings} is not a file: give the .npz of the base "
                             "model's decodings, or remove base_decodings to decode every prompt")
        if self.prompt_template is not None and "{document}" not in self.prompt_template:
            raise InputError("prompt_template must contain a {document} slot")

    def resolved_completions(self) -> list | dict | None:
        """One completion per task label (a list), or ``{task name: list}`` with ``tasks``."""
        if self.tasks:
            return {t["name"]: list(t.get("completions") or PRESETS[t["preset"]]["completions"]) for t in self.tasks}
        if self.completions:
            return list(self.completions)
        if self.preset:
            return list(PRESETS[self.preset]["completions"])
        return None

    def resolved_template(self) -> str | None:
        if self.prompt_template:
            return self.prompt_template
        if self.preset:
            return PRESETS[self.preset]["prompt_template"]
        return None

    def network_settings(self) -> dict:
        """The settings saved with the network (``network_config.json``: how it decodes and prompts)."""
        return {
            "delimiter": self.delimiter, "max_new_tokens": self.max_new_tokens, "max_length": self.max_length,
            "system": self.system, "prompt_template": self.resolved_template(),
            "use_chat_template": self.use_chat_template, "tasks": self.tasks, "reference_head": self.reference_head,
            "completions": self.resolved_completions(), "alpha": self.alpha,
        }

    def input_paths(self) -> list:
        """(flag, path) of every input a run reads, for the output-directory guard."""
        pairs = [("--data", self.data), ("--verification-data", self.verification_data),
                 ("--base-decodings", self.base_decodings)]
        pairs += [(f"--tasks[{i}].data", t.get("data")) for i, t in enumerate(self.tasks or []) if isinstance(t, dict)]
        if self.model and os.path.exists(os.path.expanduser(str(self.model))):
            pairs.append(("--model", os.path.expanduser(str(self.model))))
        return pairs

    def estimator_params(self) -> dict:
        params = dict(
            alpha=self.alpha, iterations=self.verifier_iterations, epochs=self.verifier_epochs,
            exemplar_dim=self.verifier_exemplar_dim, batch_size=self.verifier_batch_size,
            learning_rate=self.verifier_learning_rate, rescaler_max_epochs=self.verifier_rescaler_max_epochs,
            normalize=self.verifier_normalize, seed=self.seed, verbose=self.verbose,
        )
        params.update(self.verifier_options or {})
        return params
