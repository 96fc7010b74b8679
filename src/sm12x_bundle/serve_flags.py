"""The ``vllm serve`` flags a Nomad job spec writes from the job's own keys (or that would undo
them), and which of them an ``extra_args`` token sets, read the way vLLM's own parser reads it.

A job spec writes ``--gpu-memory-utilization``, ``--enable-sleep-mode`` and the rest from the
config, and the memory budget is checked against those keys. vLLM reads its command line left
to right and the last value wins, so an extra_args token that sets one of them in any spelling
would undo the key while the tool reports the key. The facts below were read in the pinned
sdists of both lanes (vLLM 0.21.0 and 0.33.0; line numbers of 0.21.0, then 0.33.0):

- ``vllm/utils/argparse_utils.py``, ``FlexibleArgumentParser.parse_args`` (l.306-322, l.379-395):
  in a token that starts with ``--``, every ``_`` of the name (after ``--``, before ``=`` and the
  first ``.``) becomes ``-``; ``--name.key value`` is a nested value of ``--name``.
- Neither ``FlexibleArgumentParser.__init__`` (l.128, l.170) nor ``vllm/entrypoints/cli/main.py``
  nor ``serve.py``'s ``add_parser`` passes ``allow_abbrev``: argparse's default (True) lets an
  unambiguous prefix stand for an option (``--gpu-mem=0.99``, ``-t 8`` for ``-tp 8``).
- ``vllm/engine/arg_utils.py``, ``get_kwargs`` (l.345, l.386): a bool field gets
  ``argparse.BooleanOptionalAction``, so ``--enable-sleep-mode`` has ``--no-enable-sleep-mode``;
  0.33.0 registers ``EnableDisableAction`` for it (argparse_utils.py l.120-146, registered at l.179), which adds
  ``--disable-sleep-mode`` and ``--no-disable-sleep-mode``.
- ``arg_utils.py`` ``EngineArgs.add_cli_args``: ``--model`` (l.764, l.969), ``--max-model-len``
  (l.786, l.991), ``--served-model-name`` (l.812, l.1031), ``--enable-sleep-mode`` (l.825,
  l.1047), ``--pipeline-parallel-size``/``-pp`` (l.923, l.1171), ``--tensor-parallel-size``/``-tp``
  (l.943, l.1209), ``--data-parallel-size``/``-dp`` (l.968, l.1241), ``--gpu-memory-utilization``
  (l.1083, l.1389; 0.33.0 adds the alias ``--device-memory-utilization``, l.1390),
  ``--kv-cache-memory-bytes`` (l.1086, l.1395).
- ``vllm/entrypoints/openai/cli_args.py`` (0.33.0: ``vllm/entrypoints/common/cli_args.py``):
  ``FrontendArgs`` fields ``host``, ``port`` and ``uds`` (l.228-232, l.313: "If set, host and port
  arguments are ignored") become ``--host``, ``--port``, ``--uds``; ``make_arg_parser`` adds
  ``--config`` (l.358, l.460: a YAML file of flags, read into the command line).
- argparse (Python 3.10-3.12): ``--opt=value`` and ``-o=value`` name the option before ``=``;
  a token that starts with ``-`` is read as an option even where an earlier option wanted a
  value; ``-tp8`` is not ``-tp 8`` (only two-character options take an attached value).

tests/test_job_rules.py (marked integration) reads the cached sdists and fails when a lane lacks
one of these flags, registers an alias of one that is missing here (it found 0.33.0's
``--device-memory-utilization``), has none of a spelling here, or has an option that is a proper
prefix of one of these (an exact option wins over an abbreviation, so the prefix rule below
would then be wrong).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeFlag:
    """One flag a job manages: every option string vLLM registers for it, and what sets it instead."""

    flag: str
    spellings: tuple[str, ...]
    instead: str  # ends "extra_args sets FLAG ..., which ..."


_GPUS = "would use more GPUs than the job holds (gpus is tensor_parallel_size)"

# The one list: what the job spec writes (outputs/nomad.vllm_args) and what would undo it.
MANAGED: tuple[ServeFlag, ...] = (
    ServeFlag("--model", ("--model",), "comes from the job's model"),
    ServeFlag("--host", ("--host",), "the job spec sets (0.0.0.0, for the health check)"),
    ServeFlag("--port", ("--port",), "comes from the job's port"),
    ServeFlag("--tensor-parallel-size", ("--tensor-parallel-size", "-tp"), "comes from the job's tensor_parallel_size"),
    ServeFlag(
        "--gpu-memory-utilization", ("--gpu-memory-utilization", "--device-memory-utilization"),
        "comes from the job's gpu_memory_utilization (the memory budget checks it)",
    ),
    ServeFlag(
        "--enable-sleep-mode",
        ("--enable-sleep-mode", "--no-enable-sleep-mode", "--disable-sleep-mode", "--no-disable-sleep-mode"),
        "comes from the job's sleep_mode",
    ),
    ServeFlag("--served-model-name", ("--served-model-name",), "comes from the job's served_model_name"),
    ServeFlag("--max-model-len", ("--max-model-len",), "comes from the job's max_model_len"),
    ServeFlag("--pipeline-parallel-size", ("--pipeline-parallel-size", "-pp"), _GPUS),
    ServeFlag("--data-parallel-size", ("--data-parallel-size", "-dp"), _GPUS),
    ServeFlag(
        "--kv-cache-memory-bytes", ("--kv-cache-memory-bytes",),
        "sizes the KV cache past the job's gpu_memory_utilization (the memory budget checks it)",
    ),
    ServeFlag("--uds", ("--uds",), "makes vLLM ignore --host and --port, so the health check finds no server"),
    ServeFlag("--config", ("--config",), "reads flags from a file the tool cannot check; give them in extra_args"),
)


def option_name(token: str) -> str | None:
    """The option a command-line token names, as vLLM's parser spells it before argparse
    sees it (``--gpu_memory_utilization=0.99`` -> ``--gpu-memory-utilization``); None: a value."""
    if not token.startswith("-"):
        return None
    name = token.split("=", 1)[0].split(".", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    return None if name in ("-", "--") else name


def managed_flag(token: str) -> ServeFlag | None:
    """The managed flag an extra_args token sets in vLLM (None: none). An exact spelling, or a
    prefix of one, which argparse takes as its abbreviation; a prefix that is ambiguous in vLLM
    fails there, so refusing it here loses nothing."""
    name = option_name(token)
    if name is None:
        return None
    for flag in MANAGED:
        if name in flag.spellings:
            return flag
    for flag in MANAGED:
        if any(_abbreviates(name, spelling) for spelling in flag.spellings):
            return flag
    return None


def _abbreviates(name: str, spelling: str) -> bool:
    # A long name abbreviates a long option, a short one a short one (argparse's option tuples).
    return spelling.startswith(name) and name.startswith("--") == spelling.startswith("--")


def spellings() -> frozenset[str]:
    """Every option string of every managed flag (for the test that keeps them in step with vLLM)."""
    return frozenset(s for flag in MANAGED for s in flag.spellings)
