"""The ``pdserve`` command: ``pdserve {launch,gateway,tokenizer,detokenizer,prefill,decode} [flags]``."""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "launch": ("pdserve.services.launcher.main", "start a whole topology on this machine"),
    "gateway": ("pdserve.services.gateway.main", "OpenAI-compatible HTTP + public gRPC API"),
    "tokenizer": ("pdserve.services.tokenizer.main", "text and chat messages to token ids"),
    "detokenizer": ("pdserve.services.detokenizer.main", "token ids to text deltas, stop strings"),
    "prefill": ("pdserve.services.prefill.main", "prefill-scheduler (writes KV to decode over NIXL)"),
    "decode": ("pdserve.services.decode.main", "decode-scheduler (or --colocated: prefills itself)"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<12} {doc}" for name, (_, doc) in COMMANDS.items()]
        print("usage: pdserve COMMAND [flags]   (pdserve COMMAND --help for its flags)\n\ncommands:")
        print("\n".join(lines))
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] == "launch":
        # Set before gRPC initializes: the launcher's forks exec at once, so it needs none of gRPC's
        # fork() handlers, which wrote "skipping fork() handlers" lines of their own (not JSON under
        # --log-format json) when a restart forked while a health check was in flight.
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    module = importlib.import_module(COMMANDS[argv[0]][0])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
