"""Gradient-communication schedules on VGG16-, BERT-base- and GPT-2-sized per-layer profiles.

Run: ``python bench/schedule.py`` (add ``--write-profiles DIR`` to keep the 1x profiles as JSON
for ``python -m ddlc schedule --layer-profile``).

Profiles come from the networks' real layer shapes: parameters per layer; forward time per
layer from a roofline, max(FLOPs / achievable FLOP/s, bytes / memory bandwidth), with the
numbers of the ``dgx-h100-ib`` hardware profile (bf16; activations and weights read or
written once); backward = 2x forward. The all-reduce fit is a ring over the 8 GPUs of one
node on that profile's intra-node link: a = 2(p-1)α, b = 2(p-1)/p · 2 bytes / bandwidth
(bf16 gradients). A link cost of k x multiplies both a and b by k. Per strategy the bench
prints the iteration time, its ratio to :func:`cost_models.layer_schedules.lower_bound`
(computed in this run), the peak of live gradient buffers and the time the strategy took
to build its schedule; ``ddlc, cap`` is ddlc's search with the memory cap set to DeAR's
peak. ``descent`` is ddlc's search before the run search (coordinate descent). ``exact``
is the proven optimum of ddlc's run schedule space
(:func:`cost_models.layer_schedules.exact_schedule`), on profiles of at most
``EXACT_MAX_LAYERS`` layers with parameters (the zoo MLP and CNN). Beyond, the proof does
not finish: on VGG16's 16 layers at 1x, 1024 states per layer are not enough after 49 s.

First, ddlc's own example models (``ddlc.zoo``): traced, planned data parallel on 8
GPUs of the same profile, and turned into per-layer profiles by
:func:`passes.decouple.layer_profile` (fp32 gradients, compute model times).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cost_models.layer_schedules import (STRATEGIES, LayerProfile, exact_schedule, lower_bound,  # noqa: E402
                                         search_schedule)
from ddlc.mesh import load_profile  # noqa: E402

HARDWARE = load_profile("dgx-h100-ib")
GPUS = 8
BYTES = 2                                   # bf16 activations, weights and gradients
FLOPS = HARDWARE.flops_for("bfloat16")
LINK_COSTS = (1, 2, 5, 10, 20, 50)
EXACT_MAX_LAYERS = 8


def linear(name, tokens, d_in, d_out, bias=True):
    """(name, params, forward FLOPs, forward bytes) of a dense layer applied to ``tokens`` rows."""
    params = d_in * d_out + (d_out if bias else 0)
    return name, params, 2 * tokens * d_in * d_out, BYTES * (tokens * (d_in + d_out) + params)


def elementwise(name, elements, params=0):
    """A normalization or embedding: memory-bound, reads and writes ``elements`` once."""
    return name, params, 5 * elements, BYTES * (2 * elements + params)


def vgg16(batch=64, image=224):
    """VGG16 (configuration D) on ``image`` x ``image`` RGB images, 1000 classes."""
    layers, c_in, side = [], 3, image
    stages = [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)]
    for stage, (c_out, convs) in enumerate(stages, 1):
        for i in range(1, convs + 1):
            params = 9 * c_in * c_out + c_out
            pixels = batch * side * side
            layers.append((f"conv{stage}_{i}", params, 2 * 9 * c_in * c_out * pixels,
                           BYTES * (pixels * (c_in + c_out) + params)))
            c_in = c_out
        side //= 2
    dims = [c_in * side * side, 4096, 4096, 1000]
    layers += [linear(f"fc{6 + i}", batch, a, b) for i, (a, b) in enumerate(zip(dims, dims[1:]))]
    return layers


def attention_core(name, batch, seq, d_model):
    """softmax(QK^T)V over all heads: two batched matmuls of 2*batch*seq^2*d FLOPs each."""
    return name, 0, 4 * batch * seq * seq * d_model, BYTES * 4 * batch * seq * d_model


def bert_base(batch=64, seq=128, vocab=30522, d=768, blocks=12, max_pos=512):
    """BERT-base with its masked-LM head (decoder tied to the word embeddings)."""
    t = batch * seq
    layers = [elementwise("embeddings", t * d, (vocab + max_pos + 2) * d + 2 * d)]
    for i in range(blocks):
        layers += [linear(f"b{i}.query", t, d, d), linear(f"b{i}.key", t, d, d),
                   linear(f"b{i}.value", t, d, d), attention_core(f"b{i}.attention", batch, seq, d),
                   linear(f"b{i}.attn_out", t, d, d), elementwise(f"b{i}.attn_ln", t * d, 2 * d),
                   linear(f"b{i}.ffn_in", t, d, 4 * d), linear(f"b{i}.ffn_out", t, 4 * d, d),
                   elementwise(f"b{i}.ffn_ln", t * d, 2 * d)]
    name, params, flops, nbytes = linear("mlm_head", t, d, d)
    head = ("mlm_head", params + 2 * d + vocab, flops + 2 * t * d * vocab, nbytes + BYTES * t * vocab)
    return layers + [linear("pooler", batch, d, d), head]


def gpt2(batch=8, seq=1024, vocab=50257, d=768, blocks=12):
    """GPT-2 small (124M); the LM head is tied to the token embedding (no parameters of its own)."""
    t = batch * seq
    layers = [elementwise("embeddings", t * d, (vocab + seq) * d)]
    for i in range(blocks):
        layers += [elementwise(f"h{i}.ln_1", t * d, 2 * d), linear(f"h{i}.c_attn", t, d, 3 * d),
                   attention_core(f"h{i}.attention", batch, seq, d), linear(f"h{i}.c_proj", t, d, d),
                   elementwise(f"h{i}.ln_2", t * d, 2 * d), linear(f"h{i}.c_fc", t, d, 4 * d),
                   linear(f"h{i}.mlp_proj", t, 4 * d, d)]
    return layers + [elementwise("ln_f", t * d, 2 * d),
                     ("lm_head", 0, 2 * t * d * vocab, BYTES * t * (d + vocab))]


MODELS = {"VGG16 (batch 64, 224x224)": vgg16, "BERT-base (batch 64, seq 128)": bert_base,
          "GPT-2 small (batch 8, seq 1024)": gpt2}


def allreduce_fit(cost: float) -> dict:
    """Ring all-reduce over GPUS devices: a + b*n seconds for n bf16 elements, on a link
    ``cost`` times as slow as the hardware profile's (latency and bandwidth)."""
    link = HARDWARE.intra_node
    return {"a": 2 * (GPUS - 1) * link.latency * cost,
            "b": 2 * (GPUS - 1) / GPUS * BYTES / link.bandwidth * cost}


def profile_dict(layers, cost: float) -> dict:
    """The per-layer profile form: roofline forward time, backward twice that."""
    rows = []
    for name, params, flops, nbytes in layers:
        forward = max(flops / FLOPS, nbytes / HARDWARE.memory_bandwidth)
        rows.append({"name": name, "params": params, "forward": forward, "backward": 2 * forward})
    return {"allreduce": allreduce_fit(cost), "layers": rows}


def report(title: str, layers) -> None:
    report_profile(title, lambda cost: profile_dict(layers, cost))


def zoo_profile(name: str):
    """A data-parallel plan of one of ddlc's example models on 8 GPUs of the hardware
    profile, as a per-layer profile (``passes.decouple.layer_profile``); returns a
    function from link cost to profile dict."""
    import torch
    import torch.nn.functional as F

    import ddlc
    from ddlc.zoo import CNN, GPT, MLP, lm_loss
    from passes.canonicalize import canonicalize
    from passes.decouple import layer_profile
    from passes.sharding import shard
    torch.manual_seed(0)
    model, batch, loss = {
        "mlp": (MLP(1024, 4096, 1024, depth=4), (torch.randn(512, 1024), torch.randn(512, 1024)), F.mse_loss),
        "gpt": (GPT(vocab=8192, d_model=512, n_heads=8, n_layers=4, seq_len=256),
                (torch.randint(0, 8192, (32, 256)),) * 2, lm_loss),
        "cnn": (CNN(width=64), (torch.randn(256, 3, 16, 16), torch.randint(0, 10, (256,))), F.cross_entropy),
    }[name]
    gm = canonicalize(ddlc.trace(model, batch, loss, torch.optim.SGD(model.parameters(), lr=0.1)))
    mesh = ddlc.Mesh((GPUS,), profile=HARDWARE)
    pins = {i.name: ddlc.sbp.parse_sbp("(S0)" if i.role == "input" else "(B)")
            for i in gm.meta["ddlc_step"].inputs}
    shard(gm, mesh, fixed=pins)
    base = layer_profile(gm, mesh)
    return lambda cost: {**base, "allreduce": {"a": base["allreduce"]["a"] * cost,
                                               "b": base["allreduce"]["b"] * cost}}


ZOO = {"ddlc.zoo MLP 1024-4096x3-1024 (batch 512)": "mlp",
       "ddlc.zoo GPT d512 x4 (batch 32, seq 256)": "gpt",
       "ddlc.zoo CNN width 64 (batch 256, 16x16)": "cnn"}


def report_profile(title: str, profile_at) -> None:
    base = LayerProfile.from_dict(profile_at(1))
    print(f"\n{title}: {len(base.layers)} layers ({len(base.param_layers)} with parameters), "
          f"{base.params / 1e6:.1f} M parameters, compute {base.compute_time * 1e3:.2f} ms/iteration")
    print(f"all-reduce fit at 1x: a = {base.a * 1e6:.0f} us, b = {base.b:.3g} s/element")
    print(f"{'link':>5} {'strategy':>11} {'ms':>9} {'/ bound':>8} {'peak MiB':>9} {'search s':>9}")
    for cost in LINK_COSTS:
        profile = LayerProfile.from_dict(profile_at(cost))
        bound = lower_bound(profile)
        print(f"{cost:>4}x {'bound':>11} {bound * 1e3:9.2f}")
        built = {name: timed(strategy, profile) for name, strategy in STRATEGIES.items()}
        built["ddlc, cap"] = timed(search_schedule, profile, memory_cap=built["dear"][0].peak_memory)
        if len(profile.param_layers) <= EXACT_MAX_LAYERS:
            exact, seconds = timed(exact_schedule, profile)
            if exact is not None:
                built["exact"] = exact, seconds
        for name, (schedule, seconds) in built.items():
            t = schedule.iteration_time
            print(f"{'':>5} {name:>11} {t * 1e3:9.2f} {t / bound:8.3f} "
                  f"{schedule.peak_memory / 2 ** 20:9.1f} {seconds:9.3f}")


def timed(strategy, profile, **options):
    """The strategy's schedule and the seconds it took to build it."""
    started = time.perf_counter()
    schedule = strategy(profile, **options)
    return schedule, time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-profiles", metavar="DIR", help="also write the 1x profiles as JSON")
    parser.add_argument("--zoo-only", action="store_true", help="only ddlc's example models")
    args = parser.parse_args(argv)
    print("per strategy: iteration time, ratio to the lower bound, peak gradient memory, search "
          "time; link = link cost (a and b multiplied)")
    for title, name in ZOO.items():
        report_profile(title + ", data parallel on 8 GPUs, per-layer profile from the plan",
                       zoo_profile(name))
    if args.zoo_only:
        return
    for title, build in MODELS.items():
        report(title, build())
        if args.write_profiles:
            os.makedirs(args.write_profiles, exist_ok=True)
            path = os.path.join(args.write_profiles, build.__name__ + ".json")
            with open(path, "w") as f:
                json.dump(profile_dict(build(), 1), f, indent=1)


if __name__ == "__main__":
    main()
