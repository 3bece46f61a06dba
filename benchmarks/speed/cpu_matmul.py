"""The HF sampler's matrix products on CPU: torch's ``linear`` vs oneDNN's packed products
(``sampler.matmul``, turnrl/samplers/onednn.py), side by side in one process.

Three measurements, each in alternating rounds after a warm-up, medians:

1. every distinct ``nn.Linear`` shape of the model at ``--rows`` rows: microseconds per product
   and the weight bytes read per second (a decode step is bound by reading the weights);
2. packing every weight once (what a new version costs the onednn sampler);
3. ``HFEngine.generate`` of ``--groups`` copies of one chat prompt, ``--tokens`` new tokens
   each (no stop token), a new version before every call, so the onednn figures include the
   repack: torch's products, oneDNN's through the ``PackedLinear`` tree (transformers' own
   pass), and oneDNN's through the lean pass (lean.py, what ``onednn`` runs where it can);
   plus the largest |log-prob difference| of torch's and the lean pass's greedy tokens.

Usage: ``python benchmarks/speed/cpu_matmul.py [--model smollm2-135m-instruct] [--threads 2]
[--rows 4 16 64 256] [--groups 4 16] [--tokens 16] [--rounds 5]``. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.nn import functional

from turnrl.models import load_model
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.samplers.lean import LeanDecoder
from turnrl.samplers.onednn import _pack, _product, onednn_unusable, packed_decoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def alternate(variants: dict[str, Callable[[], object]], rounds: int, repeat: int = 1
              ) -> dict[str, float]:
    """Median seconds per call of each variant: one warm-up call each, then ``rounds`` rounds
    calling every variant ``repeat`` times in turn (``harness.alternate``)."""
    return harness.alternate(variants, rounds, repeat=repeat).medians()


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Distinct (out, in) shapes of the model's linear weights, largest last."""
    shapes = {tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear}
    return sorted(shapes, key=lambda s: s[0] * s[1])


def products(model: torch.nn.Module, rows: Sequence[int], rounds: int) -> list[dict]:
    out = []
    for n_out, n_in in linear_shapes(model):
        weight = torch.randn(n_out, n_in, dtype=model.dtype)
        packed = _pack(weight)
        repeat = max(1, int(2e7 // (n_out * n_in)))
        for m in rows:
            x = torch.randn(m, n_in, dtype=model.dtype)
            t = alternate({"torch": lambda x=x, w=weight: functional.linear(x, w),
                           "onednn": lambda x=x, p=packed: _product(x, p, None)}, rounds, repeat)
            gb = weight.numel() * weight.element_size() / 1e9
            out.append({"shape": f"{n_out}x{n_in}", "rows": m, "torch_us": t["torch"] * 1e6,
                        "onednn_us": t["onednn"] * 1e6, "torch_gb_s": gb / t["torch"],
                        "onednn_gb_s": gb / t["onednn"], "ratio": t["torch"] / t["onednn"]})
    return out


def pack_seconds(model: torch.nn.Module, rounds: int) -> float:
    weights = list({id(m.weight): m.weight for m in model.modules()
                    if type(m) is torch.nn.Linear}.values())
    return alternate({"pack": lambda: [_pack(w) for w in weights]}, rounds)["pack"]


def generation(model, tokenizer, groups: Sequence[int], tokens: int, rounds: int) -> list[dict]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 times 23?"}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    engines = {"torch": HFEngine(model, tokenizer.pad_token_id, seed=0),
               "tree": HFEngine(model, tokenizer.pad_token_id, seed=0, matmul="onednn"),
               "onednn": HFEngine(model, tokenizer.pad_token_id, seed=0, matmul="onednn")}
    engines["tree"].decoder = packed_decoder(model)  # transformers' pass on PackedLinear
    onednn_pass = "lean" if isinstance(engines["onednn"].decoder, LeanDecoder) else "tree"
    sample = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    out = []
    def call(engine, rows):
        engine.load(None, engine.version + 1)  # a new version each call: onednn repacks, as after an update
        engine.generate([ids] * rows, sample)

    for g in groups:
        t = alternate({name: (lambda e=e, g=g: call(e, g)) for name, e in engines.items()},
                      rounds)
        greedy = SamplingParams(max_new_tokens=tokens, temperature=0.0)
        a, b = (engines[name].generate([ids] * g, greedy)[0] for name in ("torch", "onednn"))
        same = a.token_ids == b.token_ids
        drift = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) if same \
            else float("nan")
        out.append({"group": g, "torch_s": t["torch"], "tree_s": t["tree"],
                    "onednn_s": t["onednn"], "ratio": t["torch"] / t["onednn"],
                    "lean_gain": t["tree"] / t["onednn"], "onednn_pass": onednn_pass,
                    "greedy_same": same,
                    "max_dlogp": drift})
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    model.eval()
    reason = onednn_unusable(model)
    if reason:
        raise SystemExit(f"cpu_matmul: {reason}")
    load = harness.load_average()
    print(f"cpu_matmul: {args.model}, {args.threads} thread(s), {args.rounds} alternating "
          f"rounds, medians; load {load:.2f}")
    results = {"products": products(model, args.rows, args.rounds),
               "pack_s": pack_seconds(model, args.rounds),
               "generation": generation(model, tokenizer, args.groups, args.tokens, args.rounds)}
    print(f"{'shape':>12} {'rows':>5} {'torch us':>10} {'onednn us':>10} {'torch GB/s':>11} "
          f"{'onednn GB/s':>12} {'ratio':>6}")
    for r in results["products"]:
        print(f"{r['shape']:>12} {r['rows']:>5} {r['torch_us']:10.0f} {r['onednn_us']:10.0f} "
              f"{r['torch_gb_s']:11.1f} {r['onednn_gb_s']:12.1f} {r['ratio']:5.2f}x")
    print(f"packing every weight: {results['pack_s']:.3f} s")
    print(f"generate, {args.tokens} new tokens a row, a new version before each call:")
    lean = all(r["onednn_pass"] == "lean" for r in results["generation"])
    print(f"(onednn = {'the lean pass' if lean else 'the tree: this model has no lean pass'})")
    print(f"{'rows':>5} {'torch s':>8} {'tree s':>7} {'onednn s':>9} {'torch/onednn':>13} "
          f"{'tree/onednn':>12}  greedy tokens, max |dlogp|")
    for r in results["generation"]:
        print(f"{r['group']:>5} {r['torch_s']:8.3f} {r['tree_s']:7.3f} {r['onednn_s']:9.3f} "
              f"{r['ratio']:12.2f}x {r['lean_gain']:11.2f}x  "
              f"{'same' if r['greedy_same'] else 'differ'}, {r['max_dlogp']:.2e}")
    print(harness.machine(load))
    last = results["generation"][-1]
    print(harness.ratio_line(f"torch / onednn generate seconds at {last['group']} rows",
                             last["ratio"]))
    return results


if __name__ == "__main__":
    main()
