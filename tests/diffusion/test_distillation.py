"""Diffusion on-policy distillation: the step KL and the loss combination by hand (values,
gradients, bad input), the teacher check at load, the frozen teacher in the worker, and a CPU
demonstration: a student distilled on its own SDE states moves toward a pre-trained teacher;
the control, whose teacher answers for other samples' states, moves much less."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from groupflow.config import ActorConfig
from groupflow.diffusion.distillation import distillation_loss, teacher_step_kl
from groupflow.diffusion.models import (
    ModelPathError,
    TinyFlowModel,
    check_teacher_model,
    save_tiny_model,
)
from groupflow.diffusion.pretrain import pretrain_tiny_model
from groupflow.diffusion.samplers import flow_sde_step, sample_trajectory
from groupflow.diffusion.schedule import sigma_schedule
from groupflow.diffusion.worker import DiffusionSettings, DiffusionWorker, prompt_rows


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----- the math ---------------------------------------------------------------------------------


def test_step_kl_by_hand():
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 1.0]])
    teacher = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    std = torch.tensor([0.5, 2.0, 0.0])
    # (1 + 4)/2 / (2 * 0.25) = 5; (1 + 1)/2 / (2 * 4) = 0.125; std 0: ½ · (4 + 0)/2 = 1
    torch.testing.assert_close(teacher_step_kl(mean, teacher, std), torch.tensor([5.0, 0.125, 1.0]))


def test_step_kl_of_two_flow_sde_steps_by_hand():
    # σ = 0.5 → 0.25, a = 0.7: g = 0.7·sqrt(0.5/0.5) = 0.7, dt = −0.25, std = g·sqrt(0.25) = 0.35,
    # μ differs by Δv·(1 + g²(1−σ)/(2σ))·dt = 1·1.245·(−0.25) in every element
    x = torch.randn(2, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    v = torch.randn(2, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    s, s_next = torch.full((2,), 0.5), torch.full((2,), 0.25)
    mean, std = flow_sde_step(x, v, s, s_next, noise_level=0.7)
    t_mean, t_std = flow_sde_step(x, v + 1.0, s, s_next, noise_level=0.7)
    torch.testing.assert_close(std, t_std)
    expected = (1.245 * 0.25) ** 2 / (2 * 0.35**2)
    torch.testing.assert_close(teacher_step_kl(mean, t_mean, std), torch.full((2,), expected))
    assert teacher_step_kl(mean, mean.clone(), std).abs().max() == 0  # the same teacher: 0


def test_step_kl_gradient_flows_to_the_student_only():
    mean = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.double, requires_grad=True)
    teacher = torch.tensor([[0.0, 1.0, 0.5]], dtype=torch.double, requires_grad=True)
    std = torch.tensor([0.5], dtype=torch.double)
    teacher_step_kl(mean, teacher, std).sum().backward()
    # d/dμ (Σ(μ − μ_T)²/D)/(2σ²) = (μ − μ_T)/(D·σ²) = (μ − μ_T)/0.75
    torch.testing.assert_close(
        mean.grad, torch.tensor([[1 / 0.75, -3 / 0.75, 0.0]], dtype=torch.double)
    )
    assert teacher.grad is None
    m = torch.randn(2, 3, 2, dtype=torch.double, requires_grad=True)
    t = torch.randn(2, 3, 2, dtype=torch.double)
    assert torch.autograd.gradcheck(lambda a: teacher_step_kl(a, t, torch.tensor([0.3, 0.0])), m)


def test_loss_combination_by_hand():
    pg, kl = torch.tensor(0.4, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    out = distillation_loss(pg, kl, coef=0.5, reward_weight=2.0)
    assert float(out.detach()) == pytest.approx(2.0 * 0.4 + 0.5 * 2.0)
    out.backward()
    assert (float(pg.grad), float(kl.grad)) == (2.0, 0.5)
    alone = distillation_loss(pg.detach(), kl.detach(), coef=1.0, reward_weight=0.0)
    assert float(alone) == 2.0


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: teacher_step_kl(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2)), "one shape"),
        (lambda: teacher_step_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3)), "std must be"),
        (lambda: teacher_step_kl(torch.zeros(2, 3), torch.zeros(2, 3), -torch.ones(2)), ">= 0"),
        (lambda: distillation_loss(torch.tensor(1.0), torch.tensor(1.0), coef=-1), ">= 0"),
        (lambda: distillation_loss(torch.tensor(1.0), torch.tensor(1.0), coef=0, reward_weight=0),
         "both 0"),
        (lambda: distillation_loss(torch.zeros(2), torch.tensor(1.0)), "scalars"),
    ],
)  # fmt: skip
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ----- the teacher check at load -------------------------------------------------------------


def _tiny(path, labels=("red", "blue"), size=8, seed=0, width=8):
    torch.manual_seed(seed)
    return save_tiny_model(TinyFlowModel(list(labels), image_size=size, width=width), path)


def test_a_teacher_of_another_latent_or_conditioning_is_refused(tmp_path):
    student = _tiny(tmp_path / "s")
    check_teacher_model(_tiny(tmp_path / "ok", seed=1), student, "tiny")  # other weights: fine
    check_teacher_model(_tiny(tmp_path / "wide", width=16), student, "tiny")  # a larger teacher
    with pytest.raises(ValueError, match=r"teacher.path: .*image_size: student 8, teacher 16"):
        check_teacher_model(_tiny(tmp_path / "big", size=16), student, "tiny")
    with pytest.raises(ValueError, match=r"labels: student \['red', 'blue'\], teacher \['blue'"):
        check_teacher_model(_tiny(tmp_path / "lab", labels=("blue", "red")), student, "tiny")
    with pytest.raises(ModelPathError, match="teacher.path: .*nope"):
        check_teacher_model(tmp_path / "nope", student, "tiny")
    sd3 = tmp_path / "sd3"
    sd3.mkdir()
    (sd3 / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    with pytest.raises(ValueError, match="_class_name: student None"):
        check_teacher_model(sd3, sd3.parent / "s", "sd3")


# ----- the frozen teacher in the worker ------------------------------------------------------

LABELS = ["red", "green", "blue", "yellow"]


def _worker(teacher, *, reward_weight=0.0, lr=1e-2, seed=1, steps=6, fraction=0.5, **extra):
    torch.manual_seed(seed)
    student = TinyFlowModel(LABELS, image_size=8, width=8)
    distill = None if reward_weight is None else {"coef": 1.0, "reward_weight": reward_weight}
    settings = DiffusionSettings(
        num_steps=steps, timestep_fraction=fraction, distill=distill, **extra
    )
    cfg = ActorConfig(lr=lr, clip_eps_low=1e-4, grad_clip=1.0)
    return DiffusionWorker(student, settings, cfg, total_steps=100, teacher=teacher)


def _step(w, k, advantages=None):
    rows = prompt_rows(
        LABELS, [[k * 100 + i * 4 + j for j in range(4)] for i in range(4)], range(4)
    )
    b = w.generate(rows, 4)
    b["advantages"] = torch.zeros(len(b)) if advantages is None else advantages(b)
    b["old_logprobs"] = b["rollout_logprobs"]
    return w.update(
        b.select(*[key for key in b.tensors if key not in ("images", "rollout_logprobs")])
    )


@pytest.mark.parametrize("objective", ["grpo", "flow_dppo"])
def test_the_teacher_is_frozen_scored_without_grad_and_never_saved(objective):
    torch.manual_seed(5)
    teacher = TinyFlowModel(LABELS, image_size=8, width=8)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    w = _worker(teacher, reward_weight=0.5, objective=objective)
    m1, m2 = _step(w, 0), _step(w, 1)
    assert m1["actor/distill_kl"] > 0 and m2["actor/distill_kl"] > 0
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    optimized = {id(p) for g in w.optimizer.param_groups for p in g["params"]}
    assert not optimized & {id(p) for p in teacher.parameters()}
    assert set(w.state_dict()["model"]) == set(w.flow.state_dict())  # the student's only
    with pytest.raises(ValueError, match="go together"):
        DiffusionWorker(TinyFlowModel(LABELS, image_size=8, width=8), DiffusionSettings(),
                        ActorConfig(), total_steps=1, teacher=teacher)  # fmt: skip
    with pytest.raises(ValueError, match="teacher.path: the teacher's latent shape"):
        _worker(TinyFlowModel(LABELS, image_size=16, width=8))


def test_a_teacher_equal_to_the_student_adds_nothing_to_grpo():
    def advantages(b):
        return torch.linspace(-1, 1, len(b))

    torch.manual_seed(1)
    same = TinyFlowModel(LABELS, image_size=8, width=8)  # _worker's student, seed 1
    with_teacher = _worker(same, reward_weight=1.0)
    plain = _worker(None, reward_weight=None)
    a, b = _step(with_teacher, 0, advantages), _step(plain, 0, advantages)
    assert a["actor/distill_kl"] == 0.0 and "actor/distill_kl" not in b
    assert a["actor/grad_norm"] == b["actor/grad_norm"] > 0
    for p, q in zip(with_teacher.flow.parameters(), plain.flow.parameters(), strict=True):
        assert torch.equal(p, q)


def test_distillation_moves_the_student_toward_the_teacher_and_the_control_does_not():
    teacher, _ = pretrain_tiny_model(None, labels=LABELS, steps=150, image_size=8, width=8)

    class OtherStates(torch.nn.Module):
        """The control: the teacher's velocity for another sample's state (rows permuted)."""

        def __init__(self, model):
            super().__init__()
            self.model, self.latent_shape = model, model.latent_shape
            self.g = torch.Generator().manual_seed(0)

        def forward(self, x, sigma, cond):
            v = self.model(x, sigma, cond)
            return v[torch.randperm(len(v), generator=self.g)]

    def held_out(student):
        """Velocity MSE to the teacher on the teacher's own ODE states, and the squared distance
        of the images both draw from the same noise (16 fixed seeds, 4 per label)."""
        noise = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(123))
        cond = {"labels": torch.arange(16) % 4}
        sigmas = sigma_schedule(6, 3.0)
        with torch.no_grad():
            t = sample_trajectory(lambda x, s: teacher(x, s, cond), noise, sigmas, "ode")
            s = sample_trajectory(lambda x, s: student(x, s, cond), noise, sigmas, "ode")
            lat, sig = t.latents.flatten(0, 1), t.sigmas.flatten()
            c = {"labels": cond["labels"].repeat_interleave(6)}
            mse = float(((student(lat, sig, c) - teacher(lat, sig, c)) ** 2).mean())
        return mse, float(((s.final - t.final) ** 2).mean())

    runs = {}
    for name, teacher_model in (("distill", teacher), ("control", OtherStates(teacher))):
        w = _worker(copy.deepcopy(teacher_model))
        start = held_out(w.flow)
        kls = [_step(w, k)["actor/distill_kl"] for k in range(20)]
        runs[name] = (start, held_out(w.flow), kls)
    (start, distilled, kls), (start_c, control, _) = runs["distill"], runs["control"]
    assert start == start_c  # the same student, teacher and held-out states
    # measured: velocity MSE 0.555 -> 0.175 (control 0.301), image distance 0.497 -> 0.102 (0.228)
    assert distilled[0] < 0.5 * start[0] and distilled[1] < 0.4 * start[1], (start, distilled)
    assert distilled[0] < 0.7 * control[0] and distilled[1] < 0.6 * control[1], (control, distilled)
    assert sum(kls[-5:]) < 0.5 * sum(kls[:5]), kls


@pytest.mark.parametrize(
    ("kind", "cls", "text_key"),
    [("qwen_image", "QwenImageTransformer2DModel", "joint_attention_dim"),
     ("z_image", "ZImageTransformer2DModel", "cap_feat_dim"),
     ("flux2", "Flux2Transformer2DModel", "joint_attention_dim")],
)  # fmt: skip
def test_a_teacher_of_the_new_kinds_is_checked_on_latent_and_text_widths(
    kind, cls, text_key, tmp_path
):
    """A deeper teacher is fine; another text width (its prompt encoder's input) is refused, as
    is another class. Only the two config.json files are read; a pipeline folder means its
    transformer/."""
    base = {"_class_name": cls, "in_channels": 16, text_key: 16}

    def model(name, **over):
        path = tmp_path / name / "transformer"
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps({**base, **over}))
        return path.parent

    student = model("student", num_layers=1)
    check_teacher_model(model("deep", num_layers=4), student, kind)
    with pytest.raises(ValueError, match=rf"teacher.path: .*{text_key}: student 16, teacher 32"):
        check_teacher_model(model("wide", **{text_key: 32}), student, kind)
    with pytest.raises(
        ValueError, match="_class_name: student '.*', teacher 'SD3Transformer2DModel'"
    ):
        check_teacher_model(model("other", _class_name="SD3Transformer2DModel"), student, kind)
