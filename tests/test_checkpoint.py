"""Checkpoints: the sharded training state saved with torch.distributed.checkpoint and
loaded in a fresh process group on another mesh shape and world size (saved on (2, 2), loaded
on (2,)) continues exactly as an uninterrupted run; state_dict() has exactly the model's state_dict keys."""
import copy
import warnings

import pytest
import torch

import ddlc
import ddlc.errors
from ddlc.launch import spawn
from ddlc.zoo import GPT, lm_loss

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

# parameters and optimizer state sharded (decoupled updates over a fast link), so that
# loading onto another mesh really reshards
OPTIONS = {"decouple": "always"}
FAST = [ddlc.LinkModel(1e-7, 1e10)]


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(tied=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
               for _ in range(3)]
    return model, opt, batches


def _compile(model, opt, batch, mesh):
    return ddlc.compile(model, ddlc.Mesh(mesh, links=FAST * len(mesh)), batch, lm_loss, opt, **OPTIONS)


def _uninterrupted_and_saved(rank, mesh, path):
    model, opt, batches = _setup()
    step = _compile(model, opt, batches[0], mesh)
    losses = [step.step(*b) for b in batches[:2]]
    step.save_checkpoint(path)
    losses.append(step.step(*batches[2]))
    state = step.state_dict()
    model.load_state_dict(state, strict=True)  # exactly the model's own keys
    return losses, state, step.optimizer_state(), list(state)


def _resumed(rank, mesh, path):
    model, opt, batches = _setup(seed=7)  # other weights: everything must come from the file
    step = _compile(model, opt, batches[0], mesh)
    step.load_checkpoint(path)
    steps_done = step.steps_done
    loss = step.step(*batches[2])
    return loss, step.state_dict(), step.optimizer_state(), steps_done


def _resumed_with_sgd(rank, mesh, path):
    """Load the AdamW step's checkpoint into a step of another optimizer: the error."""
    model, _, batches = _setup()
    step = _compile(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), batches[0], mesh)
    try:
        step.load_checkpoint(path)
    except ddlc.errors.RuntimeMismatchError as e:
        return str(e)
    return None


def _close(a, b, what, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


#: against eager, whose sums round otherwise than the sharded ones
EAGER = dict(rtol=1e-4, atol=1e-5)


def test_resume_on_another_mesh_and_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    losses, state, opt_state, keys = spawn(_uninterrupted_and_saved, 4, (2, 2), path,
                                           timeout=120, deadline=300)[0]
    model, _, _ = _setup()
    assert keys == list(model.state_dict())  # the tied embedding under both of its names
    for mesh in [(2,)]:  # another mesh shape and world size: both mesh axes reshard
        world = mesh[0]
        loss, got, got_opt, steps_done = spawn(_resumed, world, mesh, path, timeout=120,
                                               deadline=300)[0]
        assert steps_done == 2
        _close(loss, losses[2], f"{mesh} loss after resuming")
        for k in state:
            _close(got[k], state[k], f"{mesh} {k}")
        for k in opt_state:
            _close(got_opt[k], opt_state[k], f"{mesh} {k}")
    # into a step of another optimizer: refused by name (torch raised a CheckpointException,
    # which derives from BaseException, naming one missing key)
    for message in spawn(_resumed_with_sgd, 2, (2,), path, timeout=120, deadline=300):
        assert message is not None and "saved by a step of another model or optimizer" in message
        assert "momentum_buffer" in message and "exp_avg" in message, message


def _other_checkpoint():
    """The model and optimizer state dicts of another run: seed 7, one eager step."""
    model, opt, batches = _setup(seed=7)
    opt.zero_grad()
    lm_loss(model(batches[1][0]), batches[1][1]).backward()
    opt.step()
    return model.state_dict(), opt.state_dict()


def _change(model, opt, change: str) -> None:
    """What the user does between the second and third step."""
    if change == "weights loaded":
        model.load_state_dict(_setup(seed=7)[0].state_dict())
    elif change == "checkpoint loaded":
        model_state, opt_state = _other_checkpoint()
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
    else:
        model.note = "a new attribute"  # changes nothing the step computes, but is refused


def _compiled_again(rank, mesh, change: str):
    """Two steps, a change that the step refuses, ddlc.compile again, a third step:
    (losses, the refusal, state_dict, optimizer_state) on rank 0."""
    model, opt, batches = _setup()
    step = _compile(model, opt, batches[0], mesh)
    losses = [step.step(*b) for b in batches[:2]]
    _change(model, opt, change)
    try:
        step.step(*batches[2])
        refusal = None
    except ddlc.errors.UnsupportedInputError as e:
        refusal = str(e)
    step = _compile(model, opt, batches[2], mesh)
    losses.append(step.step(*batches[2]))
    return losses, refusal, step.state_dict(), step.optimizer_state()


@pytest.mark.parametrize("change", ["attribute", "weights loaded", "checkpoint loaded"])
def test_compiling_again_continues_the_training(change):
    """The step the compiler refuses after a change to the model says to compile again;
    that continues the training as eager would: the weights and optimizer state the
    earlier step trained are written back into the model and optimizer first (AdamW's
    moments and step count too), except weights the user wrote into the model since,
    and an optimizer state loaded since, which eager would train on. Before, the new step
    started from the model's weights of before the first compile and a fresh optimizer
    state, silently; later, from the loaded weights with the earlier step's moments."""
    losses, refusal, state, opt_state = spawn(_compiled_again, 4, (2, 2), change,
                                              timeout=120, deadline=300)[0]
    assert refusal is not None and "compile again" in refusal
    if change == "checkpoint loaded":
        assert refusal.startswith("the optimizer's state changed after compile"), refusal
    model, opt, batches = _setup()
    want = []
    for i, (x, y) in enumerate(batches):
        if i == 2:
            _change(model, opt, change)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        want.append(loss.detach())
    for i, (got, expected) in enumerate(zip(losses, want)):
        _close(got, expected, f"loss {i}", **EAGER)
    for k, v in model.state_dict().items():
        _close(state[k], v, k, **EAGER)
    for name, p in model.named_parameters():
        for state_name, v in opt.state[p].items():
            got = opt_state[f"{name}:{state_name}"]
            _close(got.reshape(v.shape), v.to(got.dtype), f"{name}:{state_name}", **EAGER)


def _dropout_setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g))
    return model, opt, batch


def _eager_steps(model, opt, batch, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _users_draw(how: str) -> None:
    if how == "a draw: a seed after write_back":
        torch.manual_seed(77)
    else:
        torch.rand(3)


def _dropout_continued(rank, how):
    """Two compiled steps of a model with dropout, then two more by a new compile of the
    model or by eager steps after write_back: the four losses, and the warnings that the
    program's random numbers went apart from eager's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _dropout_losses(how)
    return losses, [str(w.message) for w in caught if issubclass(w.category, ddlc.errors.RandomStreamWarning)]


def _dropout_losses(how):
    model, opt, batch = _dropout_setup()
    step = ddlc.compile(model, (4,), batch, torch.nn.functional.cross_entropy, opt)
    losses = [float(step.step(*batch)) for _ in range(2)]
    if how.startswith("compiled again"):
        if how == "compiled again after a new seed":
            torch.manual_seed(123)  # a new phase: the user's seed, not the program's stream
        step = ddlc.compile(model, (4,), batch, torch.nn.functional.cross_entropy, opt)
        losses += [float(step.step(*batch)) for _ in range(2)]
    elif how.startswith("a draw"):
        step.write_back()
        if how == "a draw after two write_backs":
            step.write_back()  # nothing drawn since the first: the stream stays handed back
        elif how == "a draw after an inference program":
            model.eval()
            ddlc.compile(model, (4,), batch[:1])(batch[0])  # no draw in eval mode
            model.train()
        _users_draw(how)
        losses += [float(step.step(*batch)) for _ in range(2)]
    else:
        step.write_back()
        losses += _eager_steps(model, opt, batch, 2)
    return losses


@pytest.mark.parametrize("how", ["compiled again", "eager after write_back",
                                 "compiled again after a new seed", "a draw after write_back",
                                 "a draw: a seed after write_back", "a draw after two write_backs",
                                 "a draw after an inference program"])
def test_dropout_goes_on_to_new_masks_after_the_compiled_steps(how):
    """The program draws its masks from its own generator; ``write_back`` (which compiling
    the trained model again calls) hands its state to the default generator, so the steps
    after continue eager's random stream. Before, they replayed the first steps' masks.
    Unless the user moved the default generator since (``torch.manual_seed`` before
    compiling again): its state stays (it was overwritten by the program's, silently).
    The user's draws after a write-back (a sampled ``generate()`` for logging) come
    before the step's next masks, as in eager (the steps went on from their own stream)."""
    losses, apart = spawn(_dropout_continued, 4, how, timeout=120, deadline=300)[0]
    assert apart == []  # eager's numbers: no warning
    model, opt, batch = _dropout_setup()
    want = _eager_steps(model, opt, batch, 2)
    if how == "compiled again after a new seed":
        torch.manual_seed(123)
    elif how.startswith("a draw"):
        _users_draw(how)
    want += _eager_steps(model, opt, batch, 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)


def _drawn_between_steps(rank):
    """Compiled steps of a model with dropout, the loop drawing from the default generator
    between the second and the third (a diffusion loop's timesteps): the losses, and the
    warnings at each step."""
    model, opt, batch = _dropout_setup()
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    losses, warned = [], []
    for i in range(4):
        if i >= 2:
            torch.randint(0, 10, (4,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses.append(float(step.step(*batch)))
        warned.append([str(w.message) for w in caught if issubclass(w.category, ddlc.errors.RandomStreamWarning)])
    return losses, warned


def test_draws_between_compiled_steps_warn_that_the_masks_are_not_eagers():
    """The program's masks go on from its own stream, without draws the loop makes from the
    default generator between steps (documented): eager's next masks follow those draws, so
    the losses went apart from eager's silently (round AA). The first such step warns, once."""
    losses, warned = spawn(_drawn_between_steps, 2, timeout=120, deadline=200)[0]
    assert warned[:2] == [[], []] and warned[3] == []
    assert len(warned[2]) == 1 and "the default random generator moved" in warned[2][0]
    model, opt, batch = _dropout_setup()
    want = _eager_steps(model, opt, batch, 2)
    torch.testing.assert_close(torch.tensor(losses[:2]), torch.tensor(want), rtol=1e-5, atol=1e-6)


def _loaded_after_a_draw(rank, path):
    """Two compiled steps of a model with dropout and a checkpoint, a draw from the default
    generator, the checkpoint loaded, two more steps: the losses, and the warnings."""
    model, opt, batch = _dropout_setup()
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [float(step.step(*batch)) for _ in range(2)]
        step.save_checkpoint(path)
        torch.rand(3)
        step.load_checkpoint(path)
        losses += [float(step.step(*batch)) for _ in range(2)]
    return losses, [str(w.message) for w in caught if issubclass(w.category, ddlc.errors.RandomStreamWarning)]


def test_a_draw_before_a_checkpoint_is_loaded_does_not_warn(tmp_path):
    """A checkpoint restores the random stream, as an eager loop restores its random state:
    a draw before the load changes nothing, and warned (round AC)."""
    losses, warned = spawn(_loaded_after_a_draw, 2, str(tmp_path / "ckpt"), timeout=120, deadline=200)[0]
    assert warned == []
    model, opt, batch = _dropout_setup()
    want = _eager_steps(model, opt, batch, 2)
    model_state, opt_state, rng = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                                   torch.get_rng_state())
    torch.rand(3)
    model.load_state_dict(model_state)
    opt.load_state_dict(opt_state)
    torch.set_rng_state(rng)
    want += _eager_steps(model, opt, batch, 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)


class _Noisy(torch.nn.Module):
    """Noise drawn in train and eval mode (a VAE's reparametrization, a noise layer)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(12, 32), torch.nn.Linear(32, 5)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h + 0.5 * torch.randn_like(h))


def _sgd_setup(model_class):
    """``model_class()`` seeded 0, SGD with momentum over it, and a batch of 8 rows of 12."""
    torch.manual_seed(0)
    model = model_class()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g))
    return model, opt, batch


def _noisy_setup():
    return _sgd_setup(_Noisy)


def _validated_between(rank):
    """A compiled step, an inference program of the model in eval mode called once, then
    training compiled again: the losses, the validation output and the last momentum."""
    model, opt, batch = _noisy_setup()
    ce = torch.nn.functional.cross_entropy
    first = ddlc.compile(model, (4,), batch, ce, opt)
    losses = [float(first.step(*batch))]
    model.eval()
    validation = ddlc.compile(model, (4,), batch[:1])(batch[0])
    model.train()
    step = ddlc.compile(model, (4,), batch, ce, opt)
    losses += [float(step.step(*batch))]
    # the old training step gave its state up when the model was compiled again
    step.write_back()
    step.write_back()  # a second time, with no step between: nothing to hand back
    losses += _eager_steps(model, opt, batch, 1)
    step.write_back()  # after an eager step: the model and optimizer are eager's now
    losses += _eager_steps(model, opt, batch, 1)
    return losses, validation, {k: v.clone() for k, v in opt.state[model.fc1.weight].items()}


def test_draws_of_an_inference_program_and_repeated_write_backs_keep_eagers_stream():
    losses, validation, momentum = spawn(_validated_between, 4, timeout=120, deadline=300)[0]
    model, opt, batch = _noisy_setup()
    want = _eager_steps(model, opt, batch, 1)
    model.eval()
    with torch.no_grad():
        want_validation = model(batch[0])
    model.train()
    want += _eager_steps(model, opt, batch, 3)
    torch.testing.assert_close(validation, want_validation, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(momentum["momentum_buffer"], opt.state[model.fc1.weight]["momentum_buffer"],
                               rtol=1e-4, atol=1e-6)


def _alternating(rank, eager: bool = False):
    """An inference program compiled before the training step, then steps and inference
    calls in turn, both drawing noise: the losses and outputs (compiled, or eager)."""
    model, opt, batch = _noisy_setup()
    ce = torch.nn.functional.cross_entropy
    if eager:
        infer, losses, outputs = model, [], []
        for _ in range(2):
            losses += _eager_steps(model, opt, batch, 1)
            with torch.no_grad():
                outputs.append(infer(batch[0]))
        return losses + _eager_steps(model, opt, batch, 1), outputs
    infer = ddlc.compile(model, (4,), batch[:1])
    step = ddlc.compile(model, (4,), batch, ce, opt)
    losses, outputs = [], []
    for _ in range(2):
        losses.append(float(step.step(*batch)))
        outputs.append(infer(batch[0]))
    return losses + [float(step.step(*batch))], outputs


def test_a_training_step_and_an_inference_program_draw_from_one_stream():
    """Each program draws from its own generator; where a training step and an inference
    program of one model draw in turn (noise in eval mode, MC dropout), each goes on from
    the other's draws, as eager's one default generator does. Before, the inference
    program replayed the first step's noise and the steps after it ignored its draws."""
    losses, outputs = spawn(_alternating, 4, timeout=120, deadline=300)[0]
    want_losses, want_outputs = _alternating(0, eager=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    for got, want in zip(outputs, want_outputs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _one_stream(rank, path, eager: bool = False):
    """The random stream across programs, as eager's one default generator: (two models'
    steps in turn, a GAN's; an inference program seeded with ``manual_seed`` after the step
    drew; an inference program after ``load_checkpoint``): losses and outputs."""
    ce = torch.nn.functional.cross_entropy
    a, opt_a, batch = _noisy_setup()
    b, opt_b, _ = _noisy_setup()
    if eager:
        losses = []
        for _ in range(2):
            losses += _eager_steps(a, opt_a, batch, 1) + _eager_steps(b, opt_b, batch, 1)
        torch.manual_seed(5)
        with torch.no_grad():
            seeded = a(batch[0])
        return losses, seeded
    step_a = ddlc.compile(a, (4,), batch, ce, opt_a)
    step_b = ddlc.compile(b, (4,), batch, ce, opt_b)
    infer = ddlc.compile(a, (4,), batch[:1])
    losses = []
    for _ in range(2):
        losses += [float(step_a.step(*batch)), float(step_b.step(*batch))]
    infer.manual_seed(5)
    seeded = infer(batch[0])
    step_a.save_checkpoint(path)  # a's weights after its two steps
    step_a.step(*batch)
    step_a.load_checkpoint(path)
    return losses, seeded, infer(batch[0]), step_a.state_dict()


def test_every_program_draws_from_one_stream(tmp_path):
    """Two models' steps in turn (a GAN's generator and discriminator) drew the same noise,
    each program seeded alike at compile; an inference program seeded with
    ``manual_seed`` was given the other program's stream before it ran; one called after
    ``load_checkpoint`` of the training step ran on the weights before it. Every program
    now goes on from the program that drew, or was seeded or loaded, last, as eager's one
    default generator does, and a loaded step is written back before the model's
    inference program runs."""
    losses, seeded, after_load, state = spawn(_one_stream, 4, str(tmp_path / "ckpt"), timeout=120,
                                              deadline=300)[0]
    want_losses, want_seeded = _one_stream(0, None, eager=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(seeded, want_seeded, rtol=1e-5, atol=1e-6)
    model, _, batch = _noisy_setup()
    model.load_state_dict(state)  # the checkpoint's weights, and the stream where it was saved
    torch.manual_seed(5)
    with torch.no_grad():
        model(batch[0])  # the seeded call's draws
        want_after_load = model(batch[0])
    torch.testing.assert_close(after_load, want_after_load, rtol=1e-5, atol=1e-6)


def _old_step_after_a_newer_one(rank):
    model, _, batch = _dropout_setup()
    opt = torch.optim.Adam(model.parameters())  # whose state the newer step's training changed
    ce = torch.nn.functional.cross_entropy
    old = ddlc.compile(model, (4,), batch, ce, opt)
    old.step(*batch)
    new = ddlc.compile(model, (4,), batch, ce, opt)
    new.step(*batch)
    messages = []
    for _ in range(2):
        try:
            old.step(*batch)
        except ddlc.errors.UnsupportedInputError as e:
            messages.append(str(e))
        new.write_back()  # then the older step's copies are older than the model's
    return messages


def _a_step_for_another_batch_size_compiled_between_steps(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    batches = _batches_of(model)
    ce = torch.nn.functional.cross_entropy
    full = ddlc.compile(model, (4,), batches[0], ce, opt)
    losses = [float(full.step(*batches[0]))]
    ddlc.compile(model, (4,), tuple(t[:4] for t in batches[1]), ce, opt)  # never runs
    losses += [float(full.step(*b)) for b in batches[1:]]
    full.write_back()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _batches_of(model):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(3)]


def test_compiling_another_step_of_the_model_leaves_a_step_written_back_by_it_going_on():
    # compiling the second step wrote the first back and gave every rank rank 0's optimizer
    # state, which the first then took for the user's edit: refused ("the optimizer's state
    # changed after compile"), though the user changed nothing
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    want = _eager_steps_on(model, opt, _batches_of(model))
    for losses, state in spawn(_a_step_for_another_batch_size_compiled_between_steps, 4, timeout=120,
                               deadline=300):
        assert losses == pytest.approx(want, rel=1e-5)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def _eager_steps_on(model, opt, batches) -> list[float]:
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_an_older_compiled_step_is_refused_once_a_newer_one_has_trained_the_model():
    # with Adam, the refusal blamed the optimizer's state as changed by the user
    # ("optimizer.load_state_dict, an eager optimizer step"), not the newer step, before
    # the newer step's write-back and after it (one compiled step per batch shape)
    per_rank = spawn(_old_step_after_a_newer_one, 4, timeout=120, deadline=300)
    assert all(messages == per_rank[0] for messages in per_rank)
    before, after = per_rank[0]
    assert "another compiled step of this model has trained it" in before
    assert "another compiled step of this model wrote its training back into the model" in after


class _Tracked(torch.nn.Module):
    """BatchNorm statistics and a non-persistent buffer (a running mean of the features,
    kept out of ``state_dict``) that the forward updates in training mode."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 5)
        self.register_buffer("ema", torch.zeros(16), persistent=False)

    def forward(self, x):
        h = self.bn(self.fc1(x))
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return self.fc2(torch.relu(h) + self.ema)


def _tracked_setup():
    return _sgd_setup(_Tracked)


def _trained_and_evaluated(rank, eager: bool = False):
    """An inference program compiled in eval mode, a training step, then three rounds of a
    step and an evaluation, then eager steps after write_back; the same eagerly with
    ``eager``. Returns the losses, the evaluations and the buffers at the end."""
    model, opt, batch = _tracked_setup()
    ce = torch.nn.functional.cross_entropy
    if not eager:
        model.eval()
        evaluate = ddlc.compile(model, (4,), batch[:1])
        model.train()
        step = ddlc.compile(model, (4,), batch, ce, opt)
    losses, outputs = [], []
    for _ in range(3):
        model.train()
        losses += _eager_steps(model, opt, batch, 1) if eager else [float(step.step(*batch))]
        model.eval()
        with torch.no_grad():
            outputs.append(model(batch[0]) if eager else evaluate(batch[0]))
    model.train()
    if not eager:
        step.write_back()
    losses += _eager_steps(model, opt, batch, 2)
    return losses, outputs, {k: v.clone() for k, v in model.named_buffers()}


def test_an_inference_program_evaluates_the_weights_trained_since():
    """Training and evaluation alternated, as a training loop validates: each evaluation
    runs on the weights and statistics the compiled step has trained so far (it ran on the
    weights of its compile, silently), and ``write_back`` puts back every buffer, a
    non-persistent one too (it was left out: eager steps after it diverged)."""
    losses, outputs, buffers = spawn(_trained_and_evaluated, 4, timeout=120, deadline=300)[0]
    want_losses, want_outputs, want_buffers = _trained_and_evaluated(0, eager=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **EAGER)
    for got, want in zip(outputs, want_outputs):
        torch.testing.assert_close(got, want, **EAGER)
    for name, want in want_buffers.items():
        _close(buffers[name], want, name, **EAGER)


def _statistics_of_a_forward_program(rank, eager: bool = False):
    """A forward-only program in training mode called twice (it updates BatchNorm's
    statistics and the running mean), then the model in eval mode compiled again (the exact
    solver: nothing is left to choose in this program) and evaluated."""
    model, _, batch = _tracked_setup()
    with torch.no_grad():
        if eager:
            model(batch[0]), model(batch[0])
        else:
            forward = ddlc.compile(model, (4,), batch[:1])
            forward(batch[0]), forward(batch[0])
        model.eval()
        out = model(batch[0]) if eager else ddlc.compile(model, (4,), batch[:1], solver="exact")(batch[0])
    return out, {k: v.clone() for k, v in model.named_buffers()}


def test_compiling_again_keeps_the_statistics_a_forward_program_updated():
    """Compiling the model again writes back what a forward-only program updated, as it
    does for a training step (it started from the statistics of before)."""
    out, buffers = spawn(_statistics_of_a_forward_program, 4, timeout=120, deadline=300)[0]
    want, want_buffers = _statistics_of_a_forward_program(0, eager=True)
    torch.testing.assert_close(out, want, **EAGER)
    for name, value in want_buffers.items():
        _close(buffers[name], value, name, **EAGER)


def _frozen_backbone(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    model[0].requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), batch


def _saved_with_a_frozen_layer(rank, path):
    model, opt, batch = _frozen_backbone(seed=0)
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    step.step(*batch)
    step.save_checkpoint(path)
    return step.state_dict()


def _loaded_written_back_and_compiled_again(rank, path):
    model, opt, batch = _frozen_backbone(seed=1)  # other weights, the frozen ones too
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    step.load_checkpoint(path)
    step.write_back()
    written = {k: v.clone() for k, v in model.state_dict().items()}
    again = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    return written, float(again.step(*batch))


def test_a_frozen_parameter_a_checkpoint_restores_is_written_back(tmp_path):
    """``write_back`` skipped frozen parameters (the step never changes them), so the
    frozen weights ``load_checkpoint`` restored never reached the model: its export, an
    eager forward and a step compiled again ran on the fresh model's weights."""
    path = str(tmp_path / "ckpt")
    saved = spawn(_saved_with_a_frozen_layer, 2, path, timeout=120, deadline=300)[0]
    written, loss = spawn(_loaded_written_back_and_compiled_again, 2, path, timeout=120, deadline=300)[0]
    for k in saved:
        _close(written[k], saved[k], k)
    model, _, batch = _frozen_backbone(seed=0)
    model.load_state_dict(saved)
    _close(loss, float(torch.nn.functional.cross_entropy(model(batch[0]), batch[1])), "loss compiled again", **EAGER)


def _frozen_after_training(rank, path):
    model, _, batch = _frozen_backbone(seed=0)
    model[0].requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    for _ in range(2):
        step.step(*batch)
    model[0].requires_grad_(False)  # refused at the next step() until compiled again
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    step.step(*batch)
    state = step.optimizer_state()
    # Adagrad makes every parameter's state when it is built: a frozen one's untrained
    # state is not what the refusal is about
    frozen, _, _ = _frozen_backbone(seed=0)
    adagrad = ddlc.compile(frozen, (2,), batch, torch.nn.functional.cross_entropy,
                           torch.optim.Adagrad(frozen.parameters()))
    adagrad.step(*batch)
    adagrad.save_checkpoint(path + "-adagrad")
    try:
        step.save_checkpoint(path)
    except ddlc.errors.UnsupportedInputError as e:
        return state, str(e)
    return state, None


def test_the_optimizer_state_of_a_parameter_frozen_after_training_is_kept_or_refused_in_checkpoints(tmp_path):
    """A parameter Adam trained and that is frozen since keeps its moments and step count
    in eager's optimizer: ``optimizer_state()`` left them out, and a checkpoint, which does
    not carry them, lost them silently (its resumed run restarted their step count when
    they trained again). ``optimizer_state()`` now has them, and ``save_checkpoint`` is
    refused, naming the parameters and the way to save them."""
    state, refusal = spawn(_frozen_after_training, 2, str(tmp_path / "ckpt"), timeout=120, deadline=300)[0]
    model, _, batch = _frozen_backbone(seed=0)
    model[0].requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()
    model[0].requires_grad_(False)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    opt.step()
    names = dict((id(p), n) for n, p in model.named_parameters())
    want = {f"{names[id(p)]}:{k}": v for p, s in opt.state.items() for k, v in s.items()}
    assert sorted(state) == sorted(want)
    for k in want:
        _close(state[k], want[k], k, **EAGER)
    assert refusal is not None and "frozen parameter(s) 0.bias, 0.weight" in refusal and "torch.save" in refusal


def _scheduled_and_saved(rank, path):
    model, opt, batch = _frozen_backbone(seed=0)
    opt.param_groups[0].update(lr=0.05, momentum=0.5)  # where a schedule (OneCycle) has moved them
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    step.step(*batch)
    step.save_checkpoint(path)
    return float(step.step(*batch))


def _resumed_with_fresh_hyperparameters(rank, path):
    model, opt, batch = _frozen_backbone(seed=1)  # lr 0.1, momentum 0.9
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    step.load_checkpoint(path)
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    return group, float(step.step(*batch))


def test_a_checkpoint_restores_the_param_groups_hyper_parameters(tmp_path):
    """``optimizer.load_state_dict`` restores the param groups' lr and momentum, which a
    schedule moved; a checkpoint did not, so the resumed run stepped with the fresh
    optimizer's values (OneCycle's cycled momentum lost)."""
    path = str(tmp_path / "ckpt")
    want = spawn(_scheduled_and_saved, 2, path, timeout=120, deadline=300)[0]
    group, loss = spawn(_resumed_with_fresh_hyperparameters, 2, path, timeout=120, deadline=300)[0]
    assert group["lr"] == 0.05 and group["momentum"] == 0.5 and isinstance(group["nesterov"], bool)
    _close(loss, want, "loss of the step after resuming")


def _saved_with_weight_decay(rank, path):
    model, _, batch = _frozen_backbone(seed=0)
    model[0].requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.25, weight_decay=0.1)
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    step.step(*batch)
    step.save_checkpoint(path)


def _loaded_into(rank, path, how):
    model, _, batch = _frozen_backbone(seed=1)
    model[0].requires_grad_(True)
    if how == "int lr":  # an int lr and weight decay: the checkpoint's numbers, not their ints
        opt = torch.optim.SGD(model.parameters(), lr=1, weight_decay=0.5)
    elif how == "other groups":
        opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}],
                              lr=1, weight_decay=0.5)
    else:  # compiled without weight decay
        opt = torch.optim.SGD(model.parameters(), lr=1)
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    try:
        step.load_checkpoint(path)
    except ddlc.errors.RuntimeMismatchError as e:
        return str(e), opt.param_groups[0]["lr"]
    return None, (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"])


def test_param_groups_load_as_the_checkpoint_has_them_or_are_refused_changing_nothing(tmp_path):
    """The checkpoint's numbers go into the groups as they are (an int lr of 1 took
    int(0.25) = 0 and stopped training); groups holding other parameters (numbers by index
    trained them wrongly) or numbers the step was not compiled for (a weight decay turned
    on from 0: the next step was refused as the user's change) are refused at load, the
    optimizer left as it was."""
    path = str(tmp_path / "ckpt")
    spawn(_saved_with_weight_decay, 2, path, timeout=120, deadline=300)
    error, values = spawn(_loaded_into, 2, path, "int lr", timeout=120, deadline=300)[0]
    assert error is None and values == (0.25, 0.1)
    error, lr = spawn(_loaded_into, 2, path, "other groups", timeout=120, deadline=300)[0]
    assert "param groups hold other parameters than this one's" in error and lr == 1
    error, lr = spawn(_loaded_into, 2, path, "no weight decay", timeout=120, deadline=300)[0]
    assert "holds hyper-parameters this step was not compiled for (param group 0: weight_decay" in error
    assert lr == 1


def _nadam_saved(rank, path, betas, maximize):
    model, _, batch = _frozen_backbone(seed=0)
    opt = torch.optim.NAdam(model[2].parameters(), lr=0.05, betas=betas, maximize=maximize)
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    step.step(*batch)
    step.save_checkpoint(path)
    return float(step.step(*batch))


def _nadam_loaded(rank, path):
    """A step of a fresh NAdam (default betas, descending) loading the checkpoint: the
    group's betas and flags after, and the next loss or the refusal."""
    model, _, batch = _frozen_backbone(seed=1)
    opt = torch.optim.NAdam(model[2].parameters(), lr=torch.tensor(0.01))
    step = ddlc.compile(model, (2,), batch, torch.nn.functional.cross_entropy, opt)
    group = opt.param_groups[0]
    try:
        step.load_checkpoint(path)
    except ddlc.errors.RuntimeMismatchError as e:
        return str(e), group["betas"], group["maximize"], float(group["lr"])
    return float(step.step(*batch)), group["betas"], group["maximize"], float(group["lr"])


def test_a_checkpoint_restores_betas_given_as_a_list_and_refuses_flags_the_step_lacks(tmp_path):
    """Betas given as a list (from a JSON config; NAdam, RAdam and Adamax keep the list,
    Adam makes a tuple) were left out of the checkpoint, so a resumed run kept the fresh
    optimizer's (a loss 3e-3 off two steps on, round AB); flags were left
    out too, so a checkpoint of an ascending optimizer (``maximize``) resumed descending.
    Both are saved now: the betas load, and a flag the step was not compiled for is refused
    naming it, the optimizer left as it was (torch's ``load_state_dict`` would set it; the
    compiled update cannot change), a tensor lr too (round AC: it kept the checkpoint's)."""
    listed, flagged = str(tmp_path / "listed"), str(tmp_path / "flagged")
    want = spawn(_nadam_saved, 2, listed, [0.5, 0.9], False, timeout=120, deadline=300)[0]
    loss, betas, maximize, lr = spawn(_nadam_loaded, 2, listed, timeout=120, deadline=300)[0]
    assert tuple(betas) == (0.5, 0.9) and maximize is False and lr == pytest.approx(0.05)
    _close(loss, want, "loss of the step after resuming")
    spawn(_nadam_saved, 2, flagged, (0.9, 0.999), True, timeout=120, deadline=300)
    error, betas, maximize, lr = spawn(_nadam_loaded, 2, flagged, timeout=120, deadline=300)[0]
    assert "not compiled for (param group 0: maximize False -> True)" in error
    # as it was: a tensor lr was filled in place with the checkpoint's before the refusal
    assert tuple(betas) == (0.9, 0.999) and maximize is False and lr == pytest.approx(0.01)


def _hand_trained(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _hand_trained_saved_and_loaded(rank, path):
    """Two steps without an optimizer, the weights updated by hand, a checkpoint; then a
    model of other weights compiled and the checkpoint loaded into its step."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    model = _hand_trained(0)
    step = ddlc.compile(model, (2,), (x, y), F.mse_loss)
    for _ in range(2):
        step.step(x, y)
        with torch.no_grad():
            for name, grad in step.gradients().items():
                dict(model.named_parameters())[name].sub_(0.3 * grad)
    step.save_checkpoint(path)
    saved = {k: v.detach().clone() for k, v in model.named_parameters()}
    continued = float(step.step(x, y))
    other = _hand_trained(7)
    resumed = ddlc.compile(other, (2,), (x, y), F.mse_loss)
    resumed.load_checkpoint(path)
    loaded = {k: v.detach().clone() for k, v in other.named_parameters()}
    return continued, float(resumed.step(x, y)), saved, loaded


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_checkpoint_of_a_step_without_optimizer_restores_the_weights(tmp_path):
    """Such a step reads the model's weights at each call, so loading a checkpoint puts the
    weights into the model: before, the loaded ones were replaced by the model's at the
    next step, and a resumed loop that updates its weights by hand started again from the
    new model's (the next loss 0.82 off)."""
    continued, resumed, saved, loaded = spawn(_hand_trained_saved_and_loaded, 2, str(tmp_path / "ckpt"),
                                              timeout=120, deadline=140)[0]
    assert resumed == pytest.approx(continued, rel=1e-6)
    for key, value in loaded.items():
        torch.testing.assert_close(value, saved[key], msg=key)


#: optimizers ddlc added later: NAdam's product of momenta is a scalar state besides the
#: step count, AMSGrad's largest second moment a state per element, RAdam's update a
#: ``where`` on its step count (rectified from its sixth step with these betas), Adamax's
#: state a running maximum
STATEFUL = {
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, maximize=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, betas=(0.9, 0.99)),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, weight_decay=1e-2),
}


def _stateful_setup(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(7)]
    return model, STATEFUL[name](model.parameters()), batches


def _eager_step(model, opt, batch) -> float:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return float(loss.detach())


def _stateful_compile(model, opt, batch):
    """On 2 ranks, the first layer's weight and bias split by rows, the second's weight by
    columns (and so their optimizer state)."""
    pins = {"0.weight": "(S0)", "0.bias": "(S0)", "2.weight": "(S1)"}
    return ddlc.compile(model, ddlc.Mesh((2,), links=FAST), batch, torch.nn.functional.mse_loss, opt,
                        placements=pins)


def _stateful_runs(rank, name, path):
    """Three eager steps, then three compiled ones from the optimizer's state, that state
    read and saved; the write-back continued by one eager step of the user's optimizer; the
    checkpoint resumed by a step of another model."""
    model, opt, batches = _stateful_setup(name)
    for batch in batches[:3]:
        _eager_step(model, opt, batch)
    step = _stateful_compile(model, opt, batches[0])
    losses = [float(step.step(*b)) for b in batches[3:6]]
    state = {k: v.clone() for k, v in step.optimizer_state().items()}
    step.save_checkpoint(path)
    step.write_back()
    _eager_step(model, opt, batches[6])
    continued = {k: v.detach().clone() for k, v in model.state_dict().items()}
    other, other_opt, _ = _stateful_setup(name, seed=7)
    resumed = _stateful_compile(other, other_opt, batches[0])
    resumed.load_checkpoint(path)
    resumed.step(*batches[6])
    return losses, state, continued, resumed.state_dict()


@pytest.mark.parametrize("name", list(STATEFUL))
def test_the_state_of_each_added_optimizer_is_read_written_back_and_checkpointed(tmp_path, name):
    """With the optimizer state split over 2 ranks, a step compiled after three eager steps
    continues from the optimizer's state; ``optimizer_state()`` after three more is
    torch.optim's (NAdam's 0-d ``mu_product`` included); the state ``write_back`` puts into
    the user's optimizer lets its own next step continue as eager's; and a checkpoint
    resumed by a step of a model of other weights continues the same."""
    got = spawn(_stateful_runs, 2, name, str(tmp_path / "ckpt"), timeout=120, deadline=200)
    model, opt, batches = _stateful_setup(name)
    losses = [_eager_step(model, opt, batch) for batch in batches[:6]]
    names = {id(p): n for n, p in model.named_parameters()}
    want = {f"{names[id(p)]}:{k}": v.clone() for p, s in opt.state.items() for k, v in s.items()}
    _eager_step(model, opt, batches[6])
    for rank_losses, state, continued, resumed in got:
        _close(torch.tensor(rank_losses), torch.tensor(losses[3:]), "losses", **EAGER)
        assert set(state) == set(want)
        for key, value in want.items():
            assert state[key].shape == value.shape, key
            _close(state[key], value, key, **EAGER)
        for key, value in model.state_dict().items():
            _close(continued[key], value, f"continued {key}", **EAGER)
            _close(resumed[key], value, f"resumed {key}", **EAGER)
