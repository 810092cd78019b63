"""Run under torchrun (gloo): ``train.loop.train`` and ``train.evaluate.evaluate`` over the ranks equal
one process.

    torchrun --standalone --nproc_per_node 2 tests/distributed/train_ranks.py OUT_DIR
    torchrun --standalone --nproc_per_node 2 tests/distributed/train_ranks.py OUT_DIR --fail-rank 1

Every rank also trains the one-process reference itself (no collectives), so both runs are compared
in one process with one thread count. Global batches of 7 sequences split 3 / 4 with different token
counts, and the last global batch holds one sequence, so rank 0's share of it is empty. With
``--fail-rank R`` rank R raises in its third training step; the run must end with that error.
"""

import argparse
from pathlib import Path

import torch
from gloo_threads import gloo_threads  # this script's folder leads sys.path

from nmst_fast.data.wikitext import Vocabulary, encode_lines
from train import distributed
from train.config import TrainConfig
from train.corpus import builtin_splits
from train.evaluate import evaluate
from train.loop import SummedLoss, train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--fail-rank", type=int)
    args = parser.parse_args()
    world, _ = distributed.init("cpu", timeout_minutes=1.0)
    try:
        splits = builtin_splits(2, sizes=(50, 12, 9))  # 50 = 7 · 7 + 1
        vocab = Vocabulary.from_lines(splits["train"])
        tr, va, te = (encode_lines(splits[k], vocab) for k in ("train", "valid", "test"))
        if args.fail_rank is not None:
            calls = []
            forward = SummedLoss.forward

            def failing(self, *inputs):
                calls.append(1)
                if world.rank == args.fail_rank and len(calls) == 3:
                    raise RuntimeError(f"rank {world.rank} failed on purpose")
                return forward(self, *inputs)

            SummedLoss.forward = failing
            train(TrainConfig(head="nmst", eps=0.05, size="tiny", max_epochs=2, batch_size=7), tr, va, vocab,
                  args.out / "fail.pt", progress=False, world=world)
            raise AssertionError("the failing run finished")
        for head in ("nmst", "st", "va"):
            config = TrainConfig(head=head, eps=0.05, size="tiny", max_epochs=3, batch_size=7, seed=3)
            one, one_state = train(config, tr, va, vocab, args.out / f"one-{head}-{world.rank}.pt", progress=False)
            many, many_state = train(config, tr, va, vocab, args.out / f"ddp-{head}.pt", progress=False,
                                     world=world)
            for (name, a), b in zip(one.state_dict().items(), many.state_dict().values()):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{head} {name}: {m}")
            for a, b in zip(one_state.history, many_state.history):
                assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-5 * abs(a[k]) for k in a), (head, a, b)
            # Resume under torchrun: interrupted after one epoch, then continued, equals the uninterrupted run.
            train(config, tr, va, vocab, args.out / f"resumed-{head}.pt", progress=False, world=world, stop_after=1)
            resumed, _ = train(config, tr, va, vocab, args.out / f"resumed-{head}.pt", progress=False, world=world)
            for (name, a), b in zip(many.state_dict().items(), resumed.state_dict().values()):
                assert torch.equal(a, b), f"resumed {head} {name}"
            # Evaluation split over the ranks: the decoding blocks (of 4 here) seeded by index, not rank.
            alone = evaluate(one, vocab, valid=va, test=te, max_length=30, seed=1, world=distributed.World())
            split = evaluate(one, vocab, valid=va, test=te, max_length=30, seed=1, world=world)
            assert split["r_nt"] == alone["r_nt"] and split["generated_lengths"] == alone["generated_lengths"], head
            for key in ("perplexity", "valid_perplexity"):
                assert abs(split[key] - alone[key]) <= 1e-6 * alone[key], (head, key, split[key], alone[key])
            assert split["p_eos"]["t"] == alone["p_eos"]["t"]
            torch.testing.assert_close(torch.tensor(split["p_eos"]["model"]), torch.tensor(alone["p_eos"]["model"]))
            assert split["p_eos"]["data"] == alone["p_eos"]["data"]
        print(f"rank {world.rank}/{world.size}: training and evaluation equal one process", flush=True)
    finally:
        distributed.close()
    # Leaving the group ended gloo's threads (its workers and its TCP loop): none is left to run while
    # the interpreter shuts down (tests/distributed/gloo_threads.py).
    left = gloo_threads()
    assert not left, f"rank {world.rank}: gloo threads outlived the process group: {left}"


if __name__ == "__main__":
    main()
