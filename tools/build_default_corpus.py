"""Build (or find) the embedded default corpus, tokenizers and .bin/.idx files; no download.

    python tools/build_default_corpus.py [--preset stdlib|offline] [--root data/cache]
                                         [--force] [--print-dir]

prints the manifest's paths and counts and the Megatron-LM flags that use the data.
`--preset offline` builds the largest text the machine has offline for GPT only
(data/cache/offline-corpus; see megatron_2bw.data.default_data.PRESETS): the folder that
tools/studies/gpu_convergence.sh carries to a GPU machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import sys
import time
from typing import List, Optional

from megatron_2bw.data.default_data import PRESETS, ensure_default_data


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="stdlib",
                        help="which corpus (default: the embedded stdlib one)")
    parser.add_argument("--root", default="data/cache", help="cache folder (git-ignored)")
    parser.add_argument("--max-chars", type=int, help="override the preset's text budget")
    parser.add_argument("--gpt-vocab-size", type=int, help="override the preset's")
    parser.add_argument("--bert-vocab-size", type=int, help="override the preset's")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument("--print-dir", action="store_true",
                        help="print only the data folder (for scripts: $(... --print-dir))")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    overrides = {k: v for k, v in (("max_chars", args.max_chars),
                                   ("gpt_vocab_size", args.gpt_vocab_size),
                                   ("bert_vocab_size", args.bert_vocab_size)) if v is not None}
    spec = dataclasses.replace(PRESETS[args.preset], **overrides)
    if args.force:
        shutil.rmtree(f"{args.root}/{spec.subdir}", ignore_errors=True)
    start = time.time()
    data = ensure_default_data(args.root, spec, args.workers)
    if args.print_dir:
        print(data.root)
        return 0
    print(f"default data in {data.root} ({time.time() - start:.1f} s)")
    print(f"  corpus: {data.corpus or '(text not kept)'}: {data.num_documents} documents, "
          f"{data.corpus_bytes / 1e6:.2f} MB")
    print(f"  GPT:  {data.gpt_tokens} tokens; flags: {' '.join(data.gpt_flags())}")
    if data.bert_data_prefix:
        print(f"  BERT: {data.bert_tokens} tokens in {data.bert_sentences} sentences; "
              f"flags: {' '.join(data.bert_flags())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
