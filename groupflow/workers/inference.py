"""The inference worker: a frozen copy of the policy in its own pool (rollout or reference role).

Design decision: roles are colocated by default — the actor worker generates and holds the
reference itself, so weights are never copied (verl's hybrid engine). When the config places
the rollout or the reference in a separate pool (other GPUs, other nodes), that role runs in this
worker: a full, unsharded model with no optimizer and no process group (its ranks never talk to
each other; each takes its share of the batch). The driver pushes weights into it —
``load_weights`` after every update for the rollout role, once (after any warm start) for the
reference — so its methods have the same names and outputs as the actor's and the driver's calls
do not change with placement.

A rollout pool's workers (``placement.rollout``) and the asynchronous rollout side's
frozen copy (``rollout.max_staleness`` >= 1, ``RolloutView``) are this worker too and build the
configured engine (``engine``). With ``rollout.engine=vllm`` every version reaches vLLM through
the engine's ``load_weights`` — the path the actor's colocated engine takes after each update —
so pooled and stale batches come from the same engine code as colocated ones. A version that
arrives through a weight transport (``receive_weights``: Ray's object store, the collective, the
filesystem) first lands bucket by bucket in the torch model, which vLLM then copies: the worker
holds the model, vLLM's copy and one bucket, never a second full state dict. The torch model is
kept beside the engine for that and for ``compute_logprobs``.
"""

from __future__ import annotations

import torch

from groupflow.assembly.models import eos_ids
from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.distributed import register
from groupflow.distributed.transport import receive_into, tensors_nbytes, ticket_version
from groupflow.rollout.engines.base import HF
from groupflow.rollout.engines.batching import generate_batch
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.workers.common import ModelSpec, worker_device
from groupflow.workers.update import batch_logprobs

__all__ = ["InferenceWorker"]


class InferenceWorker:
    """Generation and log-probs on a frozen full model; weights arrive from the actor."""

    def __init__(self, model, tokenizer, cfg: ActorConfig, *, pad_id: int, eos_ids, role: str,
                 rank: int = 0, world_size: int = 1,
                 engine=HF):  # fmt: skip
        self.model = model.eval().requires_grad_(False)
        self.tokenizer, self.cfg, self.role = tokenizer, cfg, role
        self.pad_id, self.eos_ids = pad_id, list(eos_ids)
        self.rank, self.world_size = rank, world_size
        self.device = next(model.parameters()).device
        # the HF engine decodes with self.model; vLLM keeps a copy of its own
        self.engine = engine.build(model, tokenizer, eos_ids=self.eos_ids, pad_id=pad_id)
        self.generated_samples = 0  # what this worker generated (placement checks)
        self.taken_in_flight = -1  # the last version fetched between decode steps

    @classmethod
    def create(cls, rank: int, world_size: int, *, spec: ModelSpec, cfg: ActorConfig, role: str,
               engine=HF):  # fmt: skip
        model, tok = spec.build()
        model.to(worker_device(rank))
        return cls(model, tok, cfg, pad_id=tok.pad_token_id, eos_ids=eos_ids(tok, model),
                   role=role, rank=rank, world_size=world_size, engine=engine)  # fmt: skip

    @register("dp")
    def generate(self, prompts: Batch, params: SamplingParams, prompt_width: int = 0) -> Batch:
        out = generate_batch(self.engine, self.pad_id, prompts, params, prompt_width)
        self.generated_samples += len(out)
        return out

    @register("all")
    def generated(self) -> int:
        """Samples this worker generated so far."""
        return self.generated_samples

    @register("all")
    def take_updates_in_flight(self, updates, transport=None) -> None:
        """rollout.async_mode=in_flight: the engine calls ``updates`` between decode steps
        (``HFEngine.updates``, ``VLLMEngine.updates``). ``transport`` given (a Ray rollout pool):
        ``updates(held)`` answers a newer version's ticket, which this worker fetches itself."""
        if not hasattr(self.engine, "updates"):
            raise ValueError(
                f"rollout.async_mode=in_flight: the {self.engine.name} engine does not load "
                "weights between decode steps (use rollout.engine=hf or vllm, or async_mode=eager)"
            )
        if transport is None:
            self.engine.updates = updates
        else:
            self.engine.updates = lambda: self._fetch_in_flight(updates, transport)

    def _fetch_in_flight(self, updates, transport) -> tuple[int, dict | None]:
        """(version, weights for the engine) as ``HFEngine.updates`` answers them, from a ticket:
        the buckets land in the model in place (between two decode steps nothing reads it), and
        an engine with weights of its own (vLLM) is given the model's."""
        held = self.engine.version
        version, ticket = updates(held)
        if ticket is None or version <= held:
            return held, None
        receive_into(transport, ticket, self.model.state_dict(), role=self.role, rank=self.rank)
        self.taken_in_flight = version
        return version, dict(self.model.state_dict()) if self.engine.separate_weights else None

    @register("all")
    def engine_state(self) -> tuple[str, int]:
        """(engine name, policy version of its weights): which engine generates here, and what
        it last received."""
        return self.engine.name, self.engine.version

    @register("dp")
    def compute_logprobs(
        self, batch: Batch, *, temperature: float, reference: bool = False
    ) -> Batch:
        """Log-probs under this worker's model (``reference`` is accepted for call parity with the
        actor: a reference-role worker's model *is* the reference)."""
        if reference and self.role != "reference":
            raise RuntimeError(f"compute_logprobs(reference=True) on the {self.role} worker")
        return batch_logprobs(self.model, batch, temperature, self.cfg, self.device)

    @register("all")
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(weights)
        if self.engine.separate_weights:
            self.engine.load_weights(weights.items())

    @register("all")
    def receive_weights(self, ticket, transport) -> int:
        """Fetch a version's weights with ``transport`` (checked; a timeout names this role, rank
        and version) and load them; the bytes received."""
        version = ticket_version(ticket)
        if version == self.taken_in_flight == self.engine.version:
            return 0  # fetched between decode steps already (take_updates_in_flight)
        # bucket by bucket into the model: one bucket of extra memory, not one model
        state = self.model.state_dict()
        receive_into(transport, ticket, state, role=self.role, rank=self.rank)
        if self.engine.separate_weights:  # e.g. vLLM: its own copy, refreshed from the model's
            self.engine.load_weights(self.model.state_dict().items(), version)
        self.engine.version = version
        return tensors_nbytes(state)

    @register("all")
    def load_reference(self, weights: dict[str, torch.Tensor]) -> None:
        self.load_weights(weights)

    @register("rank0")
    def reference_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
