"""2BW through pretrain_gpt.py equals an independent single-process delayed-update loop.

The oracle is a plain loop over the megatron-core GPT model (PP=1, TP=1): gradient of
minibatch k at W_prev, clipped on the global norm, AdamW applied to W_cur, then
W_prev := old W_cur. It uses neither the executor nor the updater.
"""
from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.entry_harness import TINY, launch, losses, max_rel, minibatch_loss

ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
pytestmark = pytest.mark.slow


def _oracle(rank: int, world: int, argv: list[str]) -> list[float]:
    return delayed_oracle(argv)


def delayed_oracle(argv: list[str], sizes: Optional[Callable[[int], int]] = None
                   ) -> list[float]:
    """The loop; `sizes(consumed)` gives each minibatch's global batch size (default the
    flags' constant one), minibatch k starting after the samples consumed before it."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.training.reference import single_process_model

    ref = single_process_model("gpt", argv)
    args, run, current, previous, sample = ref.args, ref.run, ref.model, ref.build(), ref.sample
    previous.load_state_dict(current.state_dict())
    named = list(current.named_parameters())
    decay = [p for n, p in named if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in named if not (p.dim() > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, weight_decay=args.weight_decay, foreach=True)
    mbs = args.micro_batch_size
    bias = _expert_bias_rule(current, previous, args.moe_router_bias_update_rate)
    out, consumed = [], 0
    for k in range(args.train_iters):
        gbs = sizes(consumed) if sizes else run.train.global_batch_size
        out.append(minibatch_loss(previous, sample, k, gbs, mbs, consumed))
        consumed += gbs
        snapshot = {n: t.clone() if torch.is_tensor(t) else t
                    for n, t in current.state_dict().items()}
        for (_, p), q in zip(named, previous.parameters()):
            p.grad = q.grad.clone()
        torch.nn.utils.clip_grad_norm_(current.parameters(), args.clip_grad)
        opt.step()
        bias()
        previous.load_state_dict(snapshot)
    ps.destroy_model_parallel()
    return out


def _expert_bias_rule(current, previous, rate: float) -> Callable[[], None]:
    """Aux-loss-free balancing in the delayed update: minibatch k ran on W_prev (its bias
    included) and its router counts move W_cur's bias, which W_prev takes with the rest of
    the snapshot one step later: bias(k+1) = bias(k) + rate * sign(mean - counts(k))."""
    def routers(model):
        return [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]

    pairs = list(zip(routers(current), routers(previous), strict=True))

    def update() -> None:
        with torch.no_grad():
            for cur, prev in pairs:
                counts = prev.local_tokens_per_expert
                cur.expert_bias += rate * torch.sign(counts.mean() - counts)
                counts.zero_()
    return update


@pytest.mark.parametrize("nproc,flags", [
    # PP 2 alone: TP 2 x PP 2 and DP 2 x PP 2 prove it too
    pytest.param(2, ["--pipeline-model-parallel-size", "2"], marks=pytest.mark.matrix),
    (4, ["--pipeline-model-parallel-size", "4"]),
    (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
    (4, ["--pipeline-model-parallel-size", "2"]),  # DP = 2
], ids=["pp2", "pp4", "tp2-pp2", "dp2-pp2"])
def test_2bw_equals_delayed_oracle(tmp_path, nproc, flags) -> None:
    oracle = run_distributed(_oracle, 1, TINY + ITERS)[0]
    got = losses(launch("gpt", nproc, ITERS + flags + ["--pipeline-schedule", "2bw"],
                        str(tmp_path / "m.jsonl")))
    err = max_rel(got, oracle)
    print(f"2bw {' '.join(flags)}: max relative loss error vs oracle {err:.2e}")
    assert err < 1e-5
