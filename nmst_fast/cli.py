"""``nmst-fast``: the commands users run on saved models.

    nmst-fast upgrade DIR [DIR ...]        rewrite a model saved by nmst-fast 0.1 as the NMST checkpoint type
    nmst-fast export-plain DIR OUT         write an NMST model as a plain base-model checkpoint, WITHOUT its head
    nmst-fast export-gguf DIR OUT.gguf [--type f32|f16|q8_0]
                                           write an NMST model as a GGUF file for llama.cpp, with its head
    nmst-fast lm-eval run --model nmst --model_args pretrained=DIR --tasks ... [any lm-eval option]

``upgrade`` (:func:`~nmst_fast.integrations.hf.checkpoint.upgrade_checkpoint`) rewrites config.json in place and
adds ``nmst_checkpoint.py``; the weights are untouched. ``export-plain``
(:func:`~nmst_fast.integrations.hf.checkpoint.export_plain`) is for those who want the weights alone: every tool
then decodes the base model's softmax, not the head's distribution, with no termination guarantee. ``export-gguf``
(:func:`~nmst_fast.integrations.llama_cpp.export.export_gguf`) writes a file that plain llama.cpp refuses and
:mod:`nmst_fast.integrations.llama_cpp` decodes with the head (llama-cpp-python). ``lm-eval`` is
lm-eval's own command line with the model ``nmst`` registered (:mod:`nmst_fast.integrations.lm_eval`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmst-fast", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    upgrade = commands.add_parser("upgrade", help="rewrite models saved by nmst-fast 0.1 as the NMST checkpoint type")
    upgrade.add_argument("directories", nargs="+", metavar="DIR")
    export = commands.add_parser("export-plain", help="write an NMST model as a plain base-model checkpoint (the "
                                                      "weights without the head: softmax decoding)")
    export.add_argument("directory", metavar="DIR")
    export.add_argument("out", metavar="OUT", help="a new directory")
    gguf = commands.add_parser("export-gguf", help="write an NMST model as a GGUF file for llama.cpp, with its head "
                                                   "(decoded by nmst_fast.integrations.llama_cpp)")
    gguf.add_argument("directory", metavar="DIR")
    gguf.add_argument("out", metavar="OUT.gguf")
    gguf.add_argument("--type", default="f16", choices=("f32", "f16", "q8_0"),
                      help="the weights' type (default f16; vectors stay f32)")
    commands.add_parser("lm-eval", add_help=False, help="lm-eval's command line with the model 'nmst' registered "
                                                        "(nmst-fast lm-eval run --model nmst ...)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lm-eval"]:
        from lm_eval.__main__ import cli_evaluate

        from .integrations import lm_eval  # noqa: F401  (registers the model "nmst")

        sys.argv = ["lm-eval", *argv[1:]]
        cli_evaluate()
        return 0
    args = _parser().parse_args(argv)
    from .integrations.hf.checkpoint import export_plain, upgrade_checkpoint

    try:
        if args.command == "upgrade":
            for directory in args.directories:
                changed = upgrade_checkpoint(directory)
                print(f"{directory}: {'upgraded' if changed else 'already of the NMST checkpoint type'}")
        elif args.command == "export-gguf":
            from .integrations.llama_cpp.export import export_gguf, file_architecture, saved_config

            out = export_gguf(args.directory, args.out, dtype=args.type)  # says how to install gguf where it lacks
            architecture = file_architecture(saved_config(args.directory))
            print(f"{out}: the NMST model with its head, architecture {architecture} (plain llama.cpp refuses it). "
                  "Decode it with nmst_fast.integrations.llama_cpp.load(path)")
        else:
            out = export_plain(args.directory, args.out)
            print(f"{out}: a plain base-model checkpoint. It decodes the softmax of the base model's logits, NOT the "
                  "head's distribution, and has no termination guarantee")
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as error:
        print(f"nmst-fast {args.command}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
