"""What ``mlxspec run`` reads before anything loads: the model and the prompt from the
positionals and their options (-m/--model, -p/--prompt), the other names of its flags, the
prompt from stdin, and arguments made valid text."""

import re
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import UsageError
from ..models.sharding import launched
from ..options import FLAGS
from .console import print_note, replaced_note, valid_text

# starts of a MODEL argument that is never a prompt: paths and GGUF store names
MODEL_LIKE = ("/", "./", "../", "~", "ollama:", "lmstudio:")
# a Hugging Face repo id, org/name: a lone argument like this is a model, never a prompt
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def split_positionals(model: Optional[str], prompt: Optional[str]):
    """(model ref, prompt): a lone positional is the model if it names one, starts like a path
    or looks like a repo id (org/name); otherwise it is the prompt ("-": read stdin)."""
    # a mistyped folder or repo id should fail as a model, not be sent to the demo as a prompt
    if model is not None and prompt is None and (model == "-" or not names_model(model)):
        return None, model
    return model, prompt


def written_like_a_model(arg: str) -> bool:
    """Whether ARG is written as a model, never a prompt: it starts like a path or a store
    name, ends in .gguf or looks like a repo id (org/name)."""
    return bool(arg.startswith(MODEL_LIKE) or arg.lower().endswith(".gguf") or REPO_ID.fullmatch(arg))


def check_refs(model: Optional[str], draft_model: Optional[str]) -> None:
    """A MODEL or --draft-model written as a path or a repo id that names nothing fails now,
    before stdin is read or anything loaded (other names fail when loading)."""
    from ..errors import ModelNotFoundError
    from .console import missing_model_message

    for ref, what in ((model, "model"), (draft_model, "draft model")):
        if ref is not None and written_like_a_model(ref):
            message = missing_model_message(ref, what)
            if message:
                raise ModelNotFoundError(message)


MODEL_FLAGS = "-m/--model"
PROMPT_FLAGS = "-p/--prompt"


def names_model(arg: str) -> bool:
    """Whether ARG (a lone argument, or one beside -m/--model) is a model rather than the
    prompt: it is written like one or names one."""
    from ..models.loader import is_model_ref

    return written_like_a_model(arg) or is_model_ref(arg)


def model_option(options: Optional[List[str]]) -> Optional[str]:
    """-m/--model's value (None: not given), given at most once."""
    options = list(options or [])
    if len(options) > 1:
        raise UsageError(f"MODEL given twice: {MODEL_FLAGS} {options[0]!r} and {MODEL_FLAGS} {options[1]!r}; "
                         "give it once")
    return options[0] if options else None


def model_and_prompt(options: Optional[List[str]], prompt_option: Optional[str], model: Optional[str],
                     prompt: Optional[str]):
    """(model, prompt) from -m/--model, -p/--prompt and the positionals. -m/--model names the
    model: the one positional left is then the prompt; -p/--prompt names the prompt: the one
    positional left is then the model. Each given twice (or a positional model beside
    -m/--model) is a usage error naming both: nothing is silently overridden."""
    option = model_option(options)
    if option is not None and option.isdigit() and not Path(option).exists():
        raise UsageError(f"{MODEL_FLAGS} is the model here (as in llama.cpp), not mlx-lm's -m/--max-tokens; "
                         f"for at most {option} tokens use -n/--max-tokens {option}")
    args = [arg for arg in (model, prompt) if arg is not None]
    if option is not None and (len(args) == 2 or prompt_option is not None and args
                               or args and names_model(args[0])):
        raise UsageError(f"MODEL given twice: {MODEL_FLAGS} {option!r} and the argument {args[0]!r}; give it once")
    if prompt_option is not None and len(args) == 2:
        raise UsageError(f"PROMPT given twice: {PROMPT_FLAGS} {prompt_option!r} and the argument {args[1]!r}; "
                         "give it once")
    if prompt_option is not None:
        return option if option is not None else (args[0] if args else None), prompt_option
    if option is not None:
        return option, (args[0] if args else None)
    return model, prompt


def given_once(flag: str, value, alias_value, aliases: str):
    """FLAG's value, given as FLAG or as one of its other names (ALIASES, e.g. llama.cpp's):
    once; both is a usage error naming both values."""
    if value is not None and alias_value is not None:
        raise UsageError(f"{flag} given twice: {flag} {value} and {alias_value} ({aliases} is another name for "
                         f"{flag}); give it once")
    return value if value is not None else alias_value


def aliased_model(ref: Optional[str], yes: bool) -> Optional[str]:
    """An alias (config.toml's [aliases], then the catalog) -> its repo id, downloaded on first
    use after asking (or with --yes). Anything else is returned unchanged."""
    from .. import hub
    from ..models.loader import is_model_ref

    repo = hub.resolve_alias(ref) if ref else None
    if repo is None:
        return ref
    if not is_model_ref(repo):
        if not yes:
            if not sys.stdin.isatty():
                raise UsageError(f"'{ref}' is {repo}, not downloaded yet: run `mlxspec pull {ref}` or pass --yes")
            if not typer.confirm(f"'{ref}' is {repo}, not downloaded yet; download it now?", default=True):
                raise typer.Exit(1)
        from .models import pull_with_progress

        pull_with_progress(repo, None, True)
    return repo


def read_stdin() -> str:
    """Stdin as text, without its final newline; bytes that are not UTF-8 are replaced (one note)."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:
        text, replaced = valid_text(sys.stdin.read())
    else:
        raw = buffer.read()
        try:
            text, replaced = raw.decode("utf-8-sig"), False
        except UnicodeDecodeError:
            text, replaced = raw.decode("utf-8-sig", "replace"), True
    if replaced:
        print_note(replaced_note("stdin"))
    return text.rstrip("\r\n")


def prompt_text(prompt: Optional[str], chat: bool) -> Optional[str]:
    """The prompt: the argument; stdin for "-" or when it is piped and no argument is given; when
    both are given, stdin's text, a blank line, then the argument (as `llm` joins them). None
    for the chat."""
    if chat:
        return None
    if launched():  # mlx.launch forwards its stdin to every rank and never closes it: a read would wait forever
        if prompt is None or prompt == "-":
            raise UsageError("under mlx.launch give the prompt as PROMPT or -p/--prompt (stdin is not read: "
                             "mlx.launch never closes the stdin it forwards)")
        return prompt
    piped = sys.stdin is not None and not sys.stdin.isatty()
    if prompt is not None and prompt != "-":
        try:
            extra = read_stdin() if piped else ""
        except OSError:  # a stdin that cannot be read is no extra text
            extra = ""
        return f"{extra}\n\n{prompt}" if extra.strip() else prompt
    try:
        text = read_stdin() if sys.stdin is not None else ""
    except OSError as err:
        raise UsageError(f"cannot read the prompt from stdin: {err}") from None
    if not text.strip():
        raise UsageError("the prompt on stdin is empty")
    return text


def argument_text(prompt: Optional[str], system: Optional[str]):
    """PROMPT and SYSTEM as given on the command line, with bytes that were not UTF-8 replaced
    (Python hands them over as lone surrogates, which no tokenizer takes); one note if any."""
    replaced = []
    if prompt is not None:
        prompt, bad = valid_text(prompt)
        replaced += ["the PROMPT argument"] if bad else []
    if system is not None:
        system, bad = valid_text(system)
        replaced += [FLAGS["system"][0]] if bad else []
    if replaced:
        print_note(replaced_note(" and ".join(replaced)))
    return prompt, system
