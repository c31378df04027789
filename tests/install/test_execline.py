"""systemd's rules for an ExecStart= line: splitting and unquoting, specifiers, and the variable
expansion systemd does when it runs the command; and writing words back."""

from __future__ import annotations

import pytest

from specd.install.execline import (
    Command,
    expand_argv,
    expand_word,
    format_exec,
    resolve_specifiers,
    split_exec,
    unit_specifiers,
)
from specd.install.layout import InstallError


@pytest.mark.parametrize(
    ("value", "prefix", "words"),
    [
        ("/bin/x a  b", "", ["/bin/x", "a", "b"]),
        ("-/bin/x \"a b\" 'c d'", "-", ["/bin/x", "a b", "c d"]),
        ("@/bin/x argv0 --y", "@", ["/bin/x", "argv0", "--y"]),
        (
            '/bin/x "say \\"hi\\"" 100%% $HOME ${V}',
            "",
            ["/bin/x", 'say "hi"', "100%", "$HOME", "${V}"],
        ),
        ("/bin/x a\\tb \\x41", "", ["/bin/x", "a\tb", "A"]),
        ("/bin/x '' z", "", ["/bin/x", "", "z"]),
    ],
)
def test_split_exec(value: str, prefix: str, words: list[str]) -> None:
    assert split_exec(value) == (prefix, words)


def test_split_exec_refuses_an_open_quote() -> None:
    with pytest.raises(InstallError, match="unterminated quote"):
        split_exec('/bin/x "a b')


@pytest.mark.parametrize(
    "words",
    [
        ["/bin/x", "--chat-template", "a b", "--x=1"],
        ["/bin/x", "100%", 'say "hi"', "back\\slash", ";", "tab\there", ""],
        ["/bin/x", "--speculative-num-steps", "${SPECULATIVE_NUM_STEPS}", "$$literal"],
    ],
)
def test_format_exec_reads_back_as_the_same_words(words: list[str]) -> None:
    text = format_exec(Command("-", tuple(words)))
    joined = text.replace(" \\\n    ", " ")  # what systemd's line continuation yields
    assert split_exec(joined) == ("-", words)


@pytest.mark.parametrize(
    ("unit", "word", "resolved"),
    [
        ("sglang.service", "%n", "sglang.service"),
        ("sglang.service", "%N-%p", "sglang-sglang"),
        ("sglang@30001.service", "--port=%i", "--port=30001"),
        ("sglang@gpu-0.service", "%I|%i|%p|%n", "gpu/0|gpu-0|sglang|sglang@gpu-0.service"),
        ("llm-big@a.service", "%j %J %f", "big big /a"),
        ("sglang.service", "%S/sglang %t %E %h", "/var/lib/sglang /run /etc /root"),
        ("sglang.service", "100%%i", "100%i"),
        ("sglang.service", "%y", "/etc/systemd/system/sglang.service"),
    ],
)
def test_specifiers_as_systemd_resolves_them(unit: str, word: str, resolved: str) -> None:
    specifiers = unit_specifiers(unit, "/etc/systemd/system/sglang.service")
    assert resolve_specifiers(word, specifiers) == resolved


def test_a_host_specifier_is_left_to_systemd() -> None:
    assert resolve_specifiers("--name=%H", unit_specifiers("sglang.service")) is None


@pytest.mark.parametrize(
    ("word", "expanded"),
    [
        ("$$HOME", "$HOME"),
        ("a$$b$$", "a$b$"),
        ("--port=${PORT}", "--port=31000"),
        ("${PORT}${PORT}", "3100031000"),
        ("${UNSET}x", "x"),
        ("${SPACED}", "two words"),
        ("x$PORT", "x$PORT"),  # braceless inside a word: not a variable in ExecStart=
        ("${PORT:-1}", "${PORT:-1}"),  # not ExecStart= syntax: kept as written
        ("${OPEN", "${OPEN"),
    ],
)
def test_expand_word(word: str, expanded: str) -> None:
    env = {"PORT": "31000", "SPACED": "two words"}
    assert expand_word(word, env) == expanded


def test_expand_argv_splits_a_whole_word_variable() -> None:
    env = {"ARGS": "--tp-size 4  '--x=a b'", "PORT": "31000"}
    words = ["/bin/x", "$ARGS", "--port", "${PORT}", "$UNSET", "$$ARGS"]
    args = expand_argv(words, env)
    assert [a.text for a in args] == [
        "/bin/x",
        "--tp-size",
        "4",
        "--x=a b",
        "--port",
        "31000",
        "$ARGS",
    ]
    assert [a.source for a in args] == [0, 1, 1, 1, 2, 3, 5]
    assert [a.split for a in args] == [False, True, True, True, False, False, False]
