"""The check every bad command line gets: one line on stderr, exit 2, nothing written."""
from autohc.cli import main


def one_line_exit_2(capsys, argv, must_not_exist=None) -> str:
    """main(argv) exits 2 with one stderr line (returned); must_not_exist was not made. (Exit 2
    is main's return value, or the parser's SystemExit for what it refuses itself.)"""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err, err
    if must_not_exist is not None:
        assert not must_not_exist.exists(), must_not_exist
    return err
