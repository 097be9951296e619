"""ddlc on CUDA and NCCL: numerics against eager on the same GPU, and host syncs in the step.

Run: ``torchrun --nproc-per-node=NGPU bench/gpu.py [CASE,...]`` on a machine with NGPU GPUs,
or ``python bench/gpu.py`` (one GPU: one NCCL rank). Needs CUDA; exits 2 without it, except
with ``--cpu``: the same checks on one gloo rank on the CPU (a dry run of this script).

Every rank joins an NCCL process group on its own GPU (:func:`ddlc.launch.run`). For each
case (zoo MLP, GPT, tied GPT and CNN, a ResNet with BatchNorm, Hugging Face GPT-2 and BERT
from small configs, the zoo GPT under an lr schedule, resumed from a checkpoint, and through
``backend="inductor"``), on the mesh ``(NGPU,)``
and, with 4 GPUs, ``(2, 2)``: the model, batches and optimizer are built on the GPU, the
single-device reference trains a copy on the whole global batch, and ``ddlc.compile`` trains
another; after ``STEPS`` steps the losses of every step, the full parameters, buffers and
optimizer state (``CompiledStep.state_dict``, ``optimizer_state``) must match within the
tolerances of the CPU suite (``tests/conftest.py``), and every tensor the step returns must
be on the GPU. Steps after the first run under ``torch.cuda.set_sync_debug_mode("warn")``:
the synchronizing calls (a device-to-host copy, ``.item()``, ...) each step makes are
counted, for eager and for ddlc. Matmuls run in full float32 (TF32 off) so the comparison is
about the program, not the kernels' precision. Then one more step of each runs under
``torch.profiler``: the GPU operations (kernels, copies) it launched, their summed GPU time,
the step's wall time, and the kernels whose counts differ most between ddlc and eager.
"""
from __future__ import annotations

import copy
import tempfile
from collections import Counter
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ddlc  # noqa: E402
import ddlc.launch  # noqa: E402
from ddlc.zoo import CNN, GPT, MLP, lm_loss, resnet18  # noqa: E402

STEPS = 4
#: (rtol, atol) per quantity, as tests/conftest.py's TOLERANCES
TOLERANCES = {"losses": (1e-5, 1e-6), "params": (1e-4, 1e-5), "buffers": (1e-4, 1e-5),
              "opt_state": (1e-4, 1e-5)}


def _hf(kind: str):
    import transformers
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=256, max_position_embeddings=32,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _tokens(g, batch, vocab=64, seq=16):
    return torch.randint(0, vocab, (batch, seq), generator=g)


#: name -> (model factory, loss_fn, optimizer factory, batch factory(generator, global batch), options)
CASES = {
    "mlp": (lambda: MLP(), F.mse_loss,
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
            lambda g, b: (torch.randn(2 * b, 32, generator=g), torch.randn(2 * b, 16, generator=g)), {}),
    "gpt": (lambda: GPT(), lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-4),
            lambda g, b: (_tokens(g, b), _tokens(g, b)), {}),
    "gpt_tied": (lambda: GPT(tied=True), lm_loss,
                 lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4),
                 lambda g, b: (_tokens(g, b), _tokens(g, b)), {}),
    "cnn": (lambda: CNN(), F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            lambda g, b: (torch.randn(b, 3, 16, 16, generator=g), torch.randint(0, 10, (b,), generator=g)), {}),
    "resnet18_bn": (lambda: resnet18(width=8), F.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=0.002, momentum=0.9, nesterov=True),
                    lambda g, b: (torch.randn(4 * b, 3, 32, 32, generator=g),
                                  torch.randint(0, 10, (4 * b,), generator=g)), {}),
    "hf_gpt2": (lambda: _hf("gpt2"), None, lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-4),
                lambda g, b: (lambda ids: {"input_ids": ids, "labels": ids})(_tokens(g, b, 256, 32)), {}),
    "hf_bert": (lambda: _hf("bert"), None, lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-4),
                lambda g, b: {"input_ids": _tokens(g, b, 256, 32),
                              "labels": torch.randint(0, 3, (b,), generator=g)}, {}),
    "gpt_lr_schedule": (lambda: GPT(), lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-4),
                        lambda g, b: (_tokens(g, b), _tokens(g, b)), {"_schedule": True}),
    "gpt_checkpoint_resumed": (lambda: GPT(), lm_loss, lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4),
                               lambda g, b: (_tokens(g, b), _tokens(g, b)), {"_resume": True}),
    "gpt_inductor": (lambda: GPT(), lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-4),
                     lambda g, b: (_tokens(g, b), _tokens(g, b)), {"backend": "inductor"}),
}


def _to(batch, device):
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(t.to(device) for t in batch)


def _step_fn(model, loss_fn, opt, schedule=None):
    def step(batch):
        opt.zero_grad(set_to_none=True)
        if isinstance(batch, dict):
            loss = model(**batch).loss
        else:
            *inputs, target = batch
            loss = loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        if schedule is not None:
            schedule.step()
        return loss.detach()
    return step


def _halving(opt, schedule: bool):
    """An lr schedule halving the learning rate every step, where the case asks for one."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None


def _syncs(fn, batches) -> tuple[list, list]:
    """``fn`` on each batch; the synchronizing calls counted after the first step."""
    outs = [fn(batches[0])]
    if not torch.cuda.is_available():
        return outs + [fn(b) for b in batches[1:]], []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            outs += [fn(b) for b in batches[1:]]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [w for w in seen if "synchroniz" in str(w.message).lower()]
    return outs, syncs


def _profile(fn, batch) -> dict:
    """One step of ``fn`` under torch.profiler: GPU operations launched, their GPU time."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn(batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return dict(launches=len(on_gpu), wall_ms=wall * 1e3,
                gpu_ms=sum(getattr(e, "device_time", 0.0) for e in on_gpu) / 1e3,
                names=Counter(e.name[:60] for e in on_gpu))


def _compare(name: str, got: dict, want: dict) -> list[str]:
    problems = []
    for key, (rtol, atol) in TOLERANCES.items():
        expected, actual = want[key], got[key]
        pairs = (list(zip(range(len(expected)), actual, expected)) if isinstance(expected, list)
                 else [(k, actual.get(k), v) for k, v in expected.items()])
        for what, a, b in pairs:
            if a is None:
                problems.append(f"{key}[{what}] missing")
                continue
            if a.device != b.device:
                problems.append(f"{key}[{what}] on {a.device}, not {b.device}")
            try:
                torch.testing.assert_close(a.to(b.device), b, rtol=rtol, atol=atol)
            except AssertionError:
                error = (a.to(b.device) - b).abs().max()
                problems.append(f"{key}[{what}]: max |difference| {float(error):.3g}, "
                                f"max |reference| {float(b.abs().max()):.3g}")
    return problems


def run_case(name: str, mesh) -> dict:
    make_model, loss_fn, make_opt, make_batch, options = CASES[name]
    options = dict(options)
    schedule, resume = options.pop("_schedule", False), options.pop("_resume", False)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    g = torch.Generator().manual_seed(1)
    batches = [_to(make_batch(g, 4 * dist.get_world_size()), device) for _ in range(STEPS)]
    torch.manual_seed(0)
    model = make_model().to(device)
    reference = copy.deepcopy(model)
    ref_opt = make_opt(reference.parameters())
    ref_step = _step_fn(reference, loss_fn, ref_opt, _halving(ref_opt, schedule))
    ref_losses, ref_syncs = _syncs(ref_step, batches)
    want = {"losses": ref_losses, "params": dict(reference.named_parameters()),
            "buffers": {k: v for k, v in reference.state_dict().items()
                        if k not in dict(reference.named_parameters(remove_duplicate=False))},
            "opt_state": {f"{k}:{s}": v.to(torch.float32) for k, p in reference.named_parameters()
                          for s, v in ref_opt.state[p].items()}}
    opt = make_opt(model.parameters())
    lr_schedule = _halving(opt, schedule)
    start = time.perf_counter()
    compiled = ddlc.compile(model, mesh, batches[0], loss_fn, opt, **options)
    compile_s = time.perf_counter() - start

    def step(batch):
        loss = compiled.step(batch) if isinstance(batch, dict) else compiled.step(*batch)
        if lr_schedule is not None:
            lr_schedule.step()
        return loss

    if resume:  # half the steps, a checkpoint, a new compiled step of a new model loads it
        losses = [step(b) for b in batches[:STEPS // 2]]
        path = os.path.join(tempfile.gettempdir(), f"ddlc-gpu-{os.environ['MASTER_PORT']}-{name}")
        compiled.save_checkpoint(path)
        torch.manual_seed(0)
        model = make_model().to(device)
        opt = make_opt(model.parameters())
        compiled = ddlc.compile(model, mesh, batches[0], loss_fn, opt, **options)
        compiled.load_checkpoint(path)
        rest, syncs = _syncs(step, batches[STEPS // 2:])
        losses += rest
    else:
        losses, syncs = _syncs(step, batches)
    state = compiled.state_dict()
    got = {"losses": losses, "params": state,
           "buffers": {k: state.get(k) for k in want["buffers"]},
           "opt_state": {k: v.to(torch.float32) for k, v in compiled.optimizer_state().items()}}
    problems = _compare(name, got, want)
    params = {str(compiled._sbp(k)) for k in compiled.params}
    profiles = {}
    if torch.cuda.is_available():
        profiles = {"ddlc": _profile(step, batches[-1]), "eager": _profile(ref_step, batches[-1])}
    return dict(problems=problems, compile_s=compile_s, syncs=[str(w.message)[:160] for w in syncs],
                profiles=profiles, counted=STEPS // 2 - 1 if resume else STEPS - 1,
                eager_syncs=len(ref_syncs), params=sorted(params),
                loss=[float(x) for x in losses], state_on=sorted({v.device.type for v in state.values()}))


def worker(rank: int, names: list[str]):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    world = dist.get_world_size()
    meshes = [(world,)] + ([(2, 2)] if world == 4 else [])
    results = {}
    for name in names:
        for mesh in meshes:
            try:
                results[f"{name} {mesh}"] = run_case(name, mesh)
            except Exception as e:  # report and go on to the next case
                results[f"{name} {mesh}"] = dict(error=f"{type(e).__name__}: {e}",
                                                 trace=traceback.format_exc()[-3000:])
            dist.barrier()
    return results


def main(argv: list[str]) -> int:
    dry_run = "--cpu" in argv
    if dry_run:
        argv.remove("--cpu")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # ddlc.launch.run: gloo, CPU
    elif not torch.cuda.is_available():
        print("bench/gpu.py needs CUDA: no GPU here (--cpu: a dry run on the CPU)", file=sys.stderr)
        return 2
    names = argv[0].split(",") if argv else list(CASES)
    if "RANK" not in os.environ:  # one process on one GPU: a one-rank NCCL job
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    results = ddlc.launch.run(worker, 1, names, timeout=600)
    if results is None:
        return 0
    where = "gloo, CPU (dry run)" if dry_run else f"NCCL, {torch.cuda.get_device_name()}"
    print(f"ddlc on {where}: torch {torch.__version__}, "
          f"world size {int(os.environ['WORLD_SIZE'])}; {STEPS} steps per case, TF32 off")
    ok = True
    for case, r in results.items():
        if "error" in r:
            ok = False
            print(f"\n{case}: ERROR {r['error']}\n{r['trace']}")
            continue
        ok &= not r["problems"]
        verdict = "MATCH" if not r["problems"] else "DIFFER"
        print(f"{case:28s} {verdict}  compile {r['compile_s']:.1f} s; host syncs in {r['counted']} steps: "
              f"ddlc {len(r['syncs'])}, eager {r['eager_syncs']}; state on {r['state_on']}; "
              f"params {r['params']}")
        for p in r["problems"][:8]:
            print(f"    {p}")
        for s in sorted(set(r["syncs"]))[:4]:
            print(f"    sync: {s}")
        if r["profiles"]:
            d, e = r["profiles"]["ddlc"], r["profiles"]["eager"]
            print(f"    one step: GPU operations ddlc {d['launches']}, eager {e['launches']}; GPU time "
                  f"ddlc {d['gpu_ms']:.2f} ms, eager {e['gpu_ms']:.2f} ms; wall ddlc {d['wall_ms']:.2f} ms, "
                  f"eager {e['wall_ms']:.2f} ms")
            more = (d["names"] - e["names"]) + (e["names"] - d["names"])
            for kernel, _ in more.most_common(5):
                print(f"      {kernel}: ddlc {d['names'][kernel]}, eager {e['names'][kernel]}")
    print("\nALL MATCH" if ok else "\nSOME CASES FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
