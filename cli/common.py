"""What every command shares, importable from here: one-line errors with exit codes
(:mod:`cli.failures`), option and path checks (:mod:`cli.checks`), standard streams
and atomic output files (:mod:`cli.streams`), help text (:mod:`cli.help`) and model
loading with a progress bar for pulls (:mod:`cli.loading`).

Only typer is imported at module level; rich and the engine are imported where used,
so ``mlx-stream --help`` stays instant.
"""

from __future__ import annotations

from .checks import (
    SNIFF_BYTES,
    check_cache,
    check_choice,
    check_distinct,
    check_kv_bits,
    check_output_path,
    check_positive,
    check_sampling,
    check_text_file,
    same_file,
    sampling,
)
from .failures import (
    DEBUG_ENV,
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_RUNTIME,
    EXIT_USAGE,
    describe,
    error_line,
    exit_code_for,
    fail,
    handle_errors,
    silence_stdout,
)
from .help import (
    reflow,
    tidy_help,
)
from .loading import (
    cache_spec,
    load_for_cache,
    load_model,
    prefix_store,
    pull_bars,
    recall_spec,
    sizes,
)
from .streams import (
    atomic_path,
    atomic_write_csv,
    atomic_write_text,
    is_interactive,
    json_line,
    lenient_stdin,
    print_table,
    stderr_console,
)

__all__ = [
    "DEBUG_ENV",
    "EXIT_BROKEN_PIPE",
    "EXIT_INTERRUPTED",
    "EXIT_RUNTIME",
    "EXIT_USAGE",
    "SNIFF_BYTES",
    "atomic_path",
    "atomic_write_csv",
    "atomic_write_text",
    "cache_spec",
    "check_cache",
    "check_choice",
    "check_distinct",
    "check_kv_bits",
    "check_output_path",
    "check_positive",
    "check_sampling",
    "check_text_file",
    "describe",
    "error_line",
    "exit_code_for",
    "fail",
    "handle_errors",
    "is_interactive",
    "json_line",
    "lenient_stdin",
    "load_for_cache",
    "load_model",
    "prefix_store",
    "print_table",
    "pull_bars",
    "recall_spec",
    "reflow",
    "same_file",
    "sampling",
    "silence_stdout",
    "sizes",
    "stderr_console",
    "tidy_help",
]
