"""What every command's one-line errors are checked with."""


def assert_one_line_error(result, code: int, *words: str) -> None:
    """A CLI result failed with ``code`` and one stderr line naming ``words``, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in result.stdout + result.stderr
    for word in words:
        assert word in err, err


# Bad text inputs every command that reads a document refuses: (make(tmp_path) -> path,
# words the one-line error must hold).
BAD_TEXT_FILES = [
    (lambda p: p / "missing.txt", ["no such file"]),
    (lambda p: p, ["is a directory"]),
    (lambda p: (p / "empty.txt", (p / "empty.txt").write_text(""))[0], ["empty"]),
    (lambda p: (p / "bin", (p / "bin").write_bytes(b"\x7fELF\x00\x00"))[0], ["binary"]),
]
