"""Write the two local downstream tasks (next sentence pairs, which-sentence-follows
multiple choice) from the embedded corpus or any loose JSON corpus.

    python tools/make_local_tasks.py --output data/tasks [--corpus corpus.jsonl]

See megatron_2bw/finetune/local_tasks.py and docs/evaluation.md.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.finetune.local_tasks import write_local_tasks  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--corpus", default=None,
                   help="loose JSON corpus (default: the embedded corpus, built if needed)")
    p.add_argument("--output", required=True, help="directory for the task files")
    p.add_argument("--train", type=int, default=4000, help="training items per task")
    p.add_argument("--dev", type=int, default=1000, help="validation items per task")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    corpus = args.corpus
    if corpus is None:
        from megatron_2bw.data.default_data import ensure_default_data
        corpus = ensure_default_data().corpus
    if not os.path.exists(corpus):
        sys.stderr.write(f"error: no such corpus file ({corpus}); give --corpus FILE.jsonl\n")
        return 2
    for name, path in write_local_tasks(corpus, args.output, args.train, args.dev,
                                        args.seed).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
