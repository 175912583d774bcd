"""lm-evaluation-harness's model API (`lm_eval.api.model.LM`) over a hybridpar model at any mesh.

Rank 0 drives the harness; every rank computes. The harness sees a world of one (rank 0): each of
its calls becomes a command that rank 0 broadcasts (the requests as token ids), every rank runs
(hybridpar.evaluate.scoring: the data-parallel ranks share the batches, each model-parallel group
computes together) and whose results rank 0 returns to the harness. The other ranks wait in
`serve()` for the next command until rank 0 says `stop()`.

Tokenising follows the harness's Hugging Face backend on hybridpar's export (TemplateLM's context
and continuation split; bos only where the harness puts its prefix token, before an empty context
and each rolling window, as the exported tokenizer adds none itself: add_bos_token=True adds it to
every encoding, as a tokenizer whose post-processor adds it would; the rolling windows of
max_seq_len tokens), so the same checkpoint scores the same through either.
"""

from __future__ import annotations

import atexit
import json
from typing import Any, Callable, Optional

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..mesh.ranks import broadcast_from_rank0, gather_objects, mark_every_rank
from .loading import Loaded, load
from .scoring import DEFAULT_BATCH_TOKENS, score
from .tasks import generate_at_ep

# lm-evaluation-harness's default for generate_until without max_gen_toks (its Hugging Face backend's).
DEFAULT_MAX_GEN_TOKS = 256
# Prompts generated together by one model-parallel group.
GENERATE_BATCH = 16


@register_model("hybridpar")
class HybridparLM(TemplateLM):
    """`lm_eval --model hybridpar --model_args checkpoint=PATH[,tokenizer=PATH,mp=N,ep=N,dtype=float32,batch_tokens=N]`
    through `python -m hybridpar.evaluate` (which registers it), or HybridparLM(loaded=...) in a program.

    Under torchrun every rank builds it: rank 0 goes on to run the harness, the others serve rank 0's
    commands here and leave the process when it is done (SystemExit 0)."""

    def __init__(self, checkpoint: Optional[str] = None, tokenizer: Optional[str] = None, mp: int = 1,
                 dtype: Optional[str] = None, batch_tokens: int = DEFAULT_BATCH_TOKENS, add_bos_token=None,
                 ep: int = 1,
                 *, loaded: Optional[Loaded] = None, on_command: Optional[Callable[[str], None]] = None,
                 **harness_options: Any) -> None:
        super().__init__()
        from_command_line = loaded is None
        if loaded is None:
            if checkpoint is None:
                raise ValueError("the hybridpar model needs --model_args checkpoint=PATH (a hybridpar checkpoint, a "
                                 "run's checkpoints folder, a Meta folder or a Hugging Face folder)")
            loaded = load(checkpoint, tokenizer=tokenizer, mp=int(mp), ep=int(ep), dtype=dtype)
        self.loaded = loaded
        self.batch_tokens = int(batch_tokens)
        # Unset: as the tokenizer's own default encoding (transformers' tokenizer, so lm-eval's hf backend).
        self.add_bos_token = loaded.tokenizer.adds_bos if add_bos_token is None else \
            str(add_bos_token).lower() not in ("false", "0", "no")
        # The harness's batch_size, max_batch_size and device are its Hugging Face backend's knobs: batches
        # here are by tokens (batch_tokens), and the device is the mesh's.
        del harness_options
        self._stopped = False
        self.on_command = on_command  # told each command on every rank ("score 120 requests"): the trainer's watchdog
        if from_command_line and loaded.parallel.world_size > 1:
            if loaded.parallel.rank == 0:
                atexit.register(self.stop)  # the harness ends where it likes; the others learn of it then
            else:
                self.serve()
                raise SystemExit(0)

    # --- the harness's view ------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return str(self.loaded.tokenizer.path)

    @property
    def eot_token_id(self) -> int:
        return self.loaded.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.loaded.tokenizer.bos_id

    @property
    def max_length(self) -> int:
        return self.loaded.args.max_seq_len

    @property
    def device(self):
        return self.loaded.parallel.device

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        bos = self.add_bos_token if add_special_tokens is None else bool(add_special_tokens)
        return self.loaded.tokenizer.encode(string, bos=bos)

    def tok_decode(self, tokens) -> str:
        return self.loaded.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        window = self.max_length + 1  # the Hugging Face backend's truncation from the left
        scored = [((context + continuation)[-window:], len(continuation)) for _, context, continuation in requests]
        return [tuple(r) for r in self._command("score", scored)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        owners, scored = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            windows = get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                owners.append(i)
                scored.append(((context + continuation)[-(self.max_length + 1):], len(continuation)))
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._command("score", scored)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        ep = self.loaded.parallel.ep
        if ep > 1:  # rank 0 alone, before any command: the others learn of it from stop()
            raise ValueError(generate_at_ep(f"{len(requests)} requests", f"ep={ep}", "ep=1"))
        prompts = []
        for context, gen_kwargs in (req.args for req in requests):
            options = dict(gen_kwargs or {})
            until = options.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(options.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            sampled = bool(options.pop("do_sample", False)) and float(options.get("temperature", 1.0)) > 0
            tokens = self.tok_encode(context)[-max(1, self.max_length - new):]
            prompts.append(dict(tokens=tokens, new=min(new, self.max_length - len(tokens)), until=until,
                                temperature=float(options.get("temperature", 1.0)) if sampled else 0.0,
                                top_p=float(options.get("top_p", 1.0) or 1.0)))
        texts = self._command("generate", prompts)
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    # --- rank 0's commands, every rank's work ------------------------------------------------

    def _command(self, kind: str, payload: list) -> list:
        """Rank 0: have every rank run `kind` on payload; the results, in payload's order."""
        if self.loaded.parallel.world_size > 1:
            broadcast_from_rank0((kind, payload))
        return self._run(kind, payload)

    def serve(self) -> None:
        """Ranks other than 0: run rank 0's commands until it stops (raises what rank 0 failed with)."""
        while True:
            kind, payload = broadcast_from_rank0(None)
            if kind == "stop":
                if payload is not None:
                    raise mark_every_rank(RuntimeError(f"rank 0 stopped the evaluation: {payload}"))
                return
            self._run(kind, payload)

    def stop(self, error: Optional[BaseException] = None) -> None:
        """Rank 0: release the serving ranks (once), saying whether the harness failed."""
        if self._stopped or self.loaded.parallel.world_size == 1:
            return
        self._stopped = True
        broadcast_from_rank0(("stop", None if error is None else f"{type(error).__name__}: {error}"))

    def _run(self, kind: str, payload: list) -> list:
        model, parallel = self.loaded.model, self.loaded.parallel
        if self.on_command is not None:
            self.on_command(f"{kind} {len(payload)} requests")
        if kind == "score":
            return score(model, parallel, payload, batch_tokens=self.batch_tokens, what="loglikelihood requests")
        if kind == "generate":
            return self._generate(payload)
        raise ValueError(f"unknown command {kind!r}")

    def _generate(self, prompts: list[dict]) -> list[str]:
        """Each prompt's continuation, cut before its first stop string; prompts alike (the same
        generation settings) go together, the batches shared by the data-parallel ranks."""
        from ..generate import generate

        parallel, tokenizer = self.loaded.parallel, self.loaded.tokenizer
        alike: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            alike.setdefault(json.dumps([p["new"], p["temperature"], p["top_p"]]), []).append(i)
        batches = [ids[k:k + GENERATE_BATCH] for ids in alike.values() for k in range(0, len(ids), GENERATE_BATCH)]
        found = {}
        for batch in batches[parallel.dp_rank::parallel.dp_size]:
            first = prompts[batch[0]]
            out = generate(self.loaded.model, parallel, [prompts[i]["tokens"] for i in batch], first["new"],
                           temperature=first["temperature"], top_p=first["top_p"], eos_id=tokenizer.eos_id,
                           vocab_limit=tokenizer.vocab_size)
            found.update({i: _until(tokenizer.decode(tokens), prompts[i]["until"]) for i, tokens in zip(batch, out)})
        every = {}
        for share in gather_objects(found if parallel.mp_rank == 0 else {}):
            every.update(share)
        return [every[i] for i in range(len(prompts))]


def _until(text: str, stops: list[str]) -> str:
    """text up to its first stop string."""
    for stop in stops:
        if stop:
            text = text.split(stop, 1)[0]
    return text
