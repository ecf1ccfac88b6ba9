"""Request bodies for the server fuzzer (test_server_fuzz.py): valid base bodies of every POST
route of ``mlxspec serve``, and seeded mutations of them, so a mutation reaches the code behind
the first check (the tool-call parser, the chat template, the constraint compilers, the sampler)
instead of stopping at it.

What the mutations write, each where any value of a base body is: a value of another type
(null, booleans, numbers up to the non-standard JSON Python reads: ``1e309``, ``Infinity``,
``NaN``, ``-0``, integers past 4,300 digits), values a field of that name takes or nearly takes
(roles, block types, tool choices, schemas, regular expressions, grammars, option names),
arrays and objects nested 100 to 600 deep (and just under the server's limit), JSON text nested
as deep given as a string (a tool call's ``arguments``), lone UTF-16 surrogates in any string
and any key (written as the ``\\ud800`` escape a hostile client sends: Python cannot encode them
to UTF-8), a field left out, a field no surface knows, a value wrapped in an array or object.
Besides: valid values of many options at once (speculation, sampling at its bounds, penalties,
logit_bias, logprobs, a constraint), a few bodies past 256 KiB (parsed off the event loop),
and for a few the bytes themselves (cut short, not UTF-8, raw surrogate bytes, a BOM, not an
object, UTF-16 and UTF-32, which the server refuses: JSON between systems is UTF-8).

Everything comes from one ``random.Random`` per case, seeded by (seed, route, case number):
one case can be built again alone (``body_for``); a case in 8 puts a lone surrogate, and
another deep nesting, in each of the places that broke the server before, in turn.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass

MODEL = "tiny"  # the name the fuzzed server serves its model under
LONE = ["\ud800", "\udbff", "\udc00", "\udfff"]
SURROGATE = "a\ud800b"


class Raw(str):
    """A JSON literal written as is: numbers Python's json reads but json.dumps never writes
    (1e309, -0), its non-standard Infinity and NaN."""


def dumps(value) -> str:
    """VALUE as JSON text: Raw values as their text, lone surrogates as ``\\udXXX`` escapes."""
    raws: list[str] = []
    stack = [value]
    seen = set()
    while stack:  # Raw leaves -> placeholder strings, in place (iterative: values nest 600 deep)
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, (dict, list)):
            for k, item in list(v.items() if isinstance(v, dict) else enumerate(v)):
                if isinstance(item, Raw):
                    raws.append(str(item))
                    v[k] = f"\0raw{len(raws) - 1}\0"
                elif isinstance(item, (dict, list)):
                    stack.append(item)
    if isinstance(value, Raw):
        return str(value)
    text = json.dumps(value)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\0raw{i}\0"), raw, 1)
    return text


def deep(n: int, kind: str = "mixed", leaf=1):
    """Arrays and/or objects nested N deep around LEAF."""
    value = leaf
    for i in range(n):
        if kind == "list" or (kind == "mixed" and i % 2):
            value = [value]
        else:
            value = {"k": value}
    return value


def deep_schema(n: int) -> dict:
    """A JSON schema whose properties nest N deep (about 2N JSON levels)."""
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"p": schema}, "required": ["p"]}
    return schema


def deep_json_text(rng: random.Random) -> str:
    """JSON text nested deep, as a string field carries it."""
    n = rng.choice([50, 99, 101, 150, 300, 600])
    return json.dumps({"a": deep(n, rng.choice(["list", "dict", "mixed"]))})


# -- valid bodies, one list per route ----------------------------------------------------------

USER = {"role": "user", "content": "What is the weather in Paris?"}
FN = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"]}}}
TOOL = {"name": "get_weather", "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3}},
          "required": ["a"]}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

CHAT = [
    {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, USER], "max_tokens": 2,
     "temperature": 0},
    {"messages": [USER], "tools": [FN], "tool_choice": "auto", "parallel_tool_calls": False, "max_tokens": 3},
    {"messages": [USER], "tools": [FN], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
     "max_tokens": 4, "temperature": 0},
    {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                  {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}],
     "tools": [FN], "max_tokens": 2, "stream": True},
    {"messages": [USER, {"role": "assistant", "reasoning_content": "hm", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
                  {"role": "tool", "tool_call_id": "call_2", "content": "rain"}], "max_completion_tokens": 2},
    {"messages": [USER], "response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA, "strict": True}}, "max_tokens": 4, "temperature": 0},
    {"messages": [USER], "response_format": {"type": "json_object"}, "max_tokens": 3},
    {"messages": [USER], "guided_regex": "[a-z]{1,3}", "max_tokens": 3, "stream": True},
    {"messages": [USER], "guided_grammar": 'start: "yes" | "no"', "max_tokens": 3},
    {"messages": [USER], "guided_json": {"type": "array", "items": {"type": "integer"}}, "max_tokens": 4},
    {"messages": [USER], "guided_json": json.dumps(SCHEMA), "max_tokens": 4},
    {"model": MODEL, "messages": [USER], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
     "logprobs": True, "top_logprobs": 2, "stop": ["\n\n", "END"], "seed": 1, "presence_penalty": 0.5,
     "frequency_penalty": 0.1, "repetition_penalty": 1.1, "repetition_context_size": 16, "logit_bias": {"5": -1},
     "speculation": {"drafter": "pld", "depth": 2, "tree": 0, "enabled": True}, "reasoning": {"enabled": False},
     "chat_template_kwargs": {"enable_thinking": False}, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "n": 1,
     "user": "u", "metadata": {"a": "b"}, "modalities": ["text"], "reasoning_effort": "none"},
    {"messages": [USER], "reasoning": "off", "stop": "\n", "max_tokens": 2, "speculation": {"drafter": "none"}},
]

COMPLETIONS = [
    {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0},
    {"prompt": [1, 2, 3], "max_tokens": 2, "echo": True, "logprobs": 2, "stream": True, "stop": "\n", "best_of": 1,
     "seed": 3},
    {"prompt": "x = ", "max_tokens": 3, "guided_regex": "[0-9]+", "stream": True,
     "stream_options": {"include_usage": True}},
    {"prompt": "{", "response_format": {"type": "json_object"}, "max_tokens": 4, "echo": True},
    {"prompt": "a", "max_tokens": 2, "logit_bias": {"7": 2.5}, "repetition_penalty": 1.2, "top_k": 3,
     "speculation": {"drafter": "pld", "depth": 3}},
]

MESSAGES = [
    {"model": MODEL, "messages": [USER], "max_tokens": 2, "system": "Be brief.", "temperature": 0},
    {"model": MODEL, "max_tokens": 3, "tools": [TOOL], "tool_choice": {"type": "auto"}, "messages": [
        USER,
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "warm"}]}]}]},
    {"model": MODEL, "max_tokens": 4, "tools": [TOOL], "messages": [USER],
     "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}},
    {"model": MODEL, "max_tokens": 2, "stream": True, "stop_sequences": ["\n\n", "END"],
     "thinking": {"type": "disabled"}, "system": [{"type": "text", "text": "Be brief."}],
     "messages": [USER, {"role": "assistant", "content": "Sure, it is"}], "top_p": 0.9, "top_k": 5,
     "metadata": {"user_id": "u"}, "speculation": {"drafter": "none"}},
    {"model": MODEL, "max_tokens": 2, "thinking": {"type": "enabled", "budget_tokens": 100, "display": "omitted"},
     "messages": [USER, {"role": "assistant", "content": [
         {"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "redacted_thinking", "data": "x"},
         {"type": "text", "text": "Paris"}]}, {"role": "user", "content": "Thanks"}]},
    {"model": MODEL, "max_tokens": 3, "tools": [TOOL], "tool_choice": {"type": "any"}, "messages": [USER],
     "stream": True},
]

COUNT = [
    {"model": MODEL, "messages": [USER], "system": "Be brief."},
    {k: v for k, v in MESSAGES[1].items() if k != "max_tokens"},
    {"model": MODEL, "messages": [USER, {"role": "assistant", "content": "Sure"}], "tools": [TOOL],
     "tool_choice": {"type": "tool", "name": "get_weather"}, "max_tokens": 5, "thinking": {"type": "adaptive"},
     "chat_template_kwargs": {"enable_thinking": False}},
    MESSAGES[4],
]

OLLAMA_CHAT = [
    {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, USER], "stream": False,
     "options": {"num_predict": 2, "temperature": 0}},
    {"model": MODEL + ":latest", "stream": True, "tools": [FN], "options": {"num_predict": 3}, "messages": [
        USER, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]},
    {"model": MODEL, "messages": [USER], "format": SCHEMA, "stream": False, "think": False,
     "options": {"num_predict": 4, "seed": 1, "top_k": 5, "top_p": 0.5, "min_p": 0.1, "repeat_penalty": 1.1,
                 "repeat_last_n": 8, "presence_penalty": 0.1, "frequency_penalty": 0.1, "stop": ["\n"],
                 "num_ctx": 2048, "mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0},
     "logprobs": True, "top_logprobs": 2, "keep_alive": "5m"},
    {"model": MODEL, "stream": False, "format": "json", "options": {"num_predict": 3}, "messages": [
        USER, {"role": "assistant", "thinking": "hm", "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]},
    {"model": MODEL, "messages": [], "keep_alive": 0},
    {"model": MODEL, "messages": [USER], "stream": True, "think": "low", "options": {"num_predict": 2},
     "speculation": {"drafter": "pld", "depth": 2}},
]

OLLAMA_GENERATE = [
    {"model": MODEL, "prompt": "Why is the sky blue?", "stream": False, "options": {"num_predict": 2}},
    {"model": MODEL, "prompt": "def add(a, b):", "raw": True, "stream": True, "options": {"num_predict": 3,
                                                                                           "stop": "\n"}},
    {"model": MODEL, "prompt": "hi", "system": "Be brief.", "format": "json", "think": False, "stream": False,
     "options": {"num_predict": 4, "temperature": 0.2, "repeat_last_n": -1}, "logprobs": True},
    {"model": MODEL, "prompt": "hi", "format": {"type": "string"}, "stream": False, "options": {"num_predict": 2}},
    {"model": MODEL},
    {"model": MODEL + ":latest", "prompt": "", "keep_alive": 0},
]

SHOW = [{"model": MODEL}, {"name": MODEL + ":latest", "verbose": True}]

INFILL = [  # llama.cpp's /infill (test_fim.py fuzzes it on a model with FIM tokens)
    {"input_prefix": "def add(a, b):\n", "input_suffix": "\n", "n_predict": 2, "temperature": 0},
    {"model": MODEL, "input_prefix": "x = 1\n", "input_suffix": "y = 2\n", "prompt": "z", "stream": True,
     "input_extra": [{"filename": "a.py", "text": "x = 1\n", "time": 0}, {"text": "y"}], "n_predict": 3,
     "top_k": 5, "top_p": 0.9, "min_p": 0.1, "seed": -1, "stop": ["\n\n"], "cache_prompt": True,
     "samplers": ["top_k", "top_p", "infill"], "t_max_predict_ms": 500, "speculation": {"drafter": "pld"}},
]

RESPONSE_TOOL = {"type": "function", **FN["function"]}  # flat, as /v1/responses takes tools
RESPONSES = [
    {"model": MODEL, "input": "What is the weather in Paris?", "instructions": "Be brief.", "max_output_tokens": 2,
     "temperature": 0},
    {"input": [USER, {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                      "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
               {"role": "developer", "content": [{"type": "input_text", "text": "And tomorrow?"}]}],
     "tools": [RESPONSE_TOOL], "tool_choice": "auto", "max_output_tokens": 3, "stream": True},
    {"input": [USER], "tools": [RESPONSE_TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
     "max_output_tokens": 4, "parallel_tool_calls": False},
    {"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}},
     "max_output_tokens": 4, "stream": True, "reasoning": {"effort": "none", "summary": "auto"}},
    {"input": [USER, {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny"}]}], "max_output_tokens": 2,
     "store": False, "metadata": {"a": "b"}, "user": "u", "top_p": 0.9, "speculation": {"drafter": "pld"},
     "text": {"format": {"type": "json_object"}}, "include": ["reasoning.encrypted_content"]},
]

ROUTES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/messages": MESSAGES,
    "/v1/messages/count_tokens": COUNT,
    "/api/chat": OLLAMA_CHAT,
    "/api/generate": OLLAMA_GENERATE,
    "/api/show": SHOW,
    "/infill": INFILL,
    "/v1/responses": RESPONSES,
}

# a valid request per route, to tell that a kept-alive connection still serves one
VALID = {path: bodies[0] for path, bodies in ROUTES.items()}


# -- what mutations write ----------------------------------------------------------------------

NUMBERS = [0, 1, -1, 2, 3, 4, 5, 0.5, -0.5, 1.5, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30,
           1e308, -1e308, 1e-300, 5e-324, Raw("1e309"), Raw("-1e309"), Raw("Infinity"), Raw("-Infinity"),
           Raw("NaN"), Raw("-0"), Raw("-0.0"), Raw("1e-400"), Raw("1E400"), Raw("0e0"), Raw("1" * 4400),
           Raw("-" + "9" * 4400), Raw("1" + "0" * 400), Raw("-1" + "0" * 400), Raw("1" + "0" * 400 + ".5")]
STRINGS = ["", " ", "x", "0", "1", "-1", "true", "null", "NaN", "Infinity", "1e309", MODEL, SURROGATE, "\ud800",
           "\udfff", "\udc00\ud800", "a\x00b", "\u2028", "\U0001F600", "<tool_call>", "</tool_call>",
           "<|im_end|>", "<think>", "{{ 7*7 }}", "{% raw %}", "\\", '"', "a" * 300, "\n" * 50]
CONTAINERS = [[], [1], [None], [""], ["x", "y"], [{}], [[]], {}, {"a": 1}, {"": None}, {SURROGATE: 1},
              {"type": "text", "text": "x"}, {"role": "user", "content": "x"}]


def other_values() -> list:
    return [None, True, False, *NUMBERS, *STRINGS, *CONTAINERS]


def surrogated(rng: random.Random, text: str) -> str:
    """TEXT with a lone surrogate (or, now and then, a reversed or valid pair) put in."""
    piece = rng.choice(LONE + ["\udc00\ud800", "\ud800\ud800", "\U0001F600"])
    at = rng.randint(0, len(text))
    return text[:at] + piece + text[at:]


SCHEMAS = [
    {"type": "object"}, {"type": "string"}, {"type": "integer", "minimum": 5, "maximum": 1},
    {"type": "string", "pattern": "["}, {"type": "string", "pattern": "(a+)+$"}, {"type": "strin"},
    {"$ref": "#"}, {"$ref": "#/definitions/missing"}, {"allOf": [{"$ref": "#"}]}, {"anyOf": []}, {"enum": []},
    {"type": ["string", "null"]}, {"type": "array", "minItems": 10**9}, {"type": "array", "maxItems": -1},
    {"type": "string", "format": "date-time"}, {"type": "object", "required": ["missing"]},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 2**63}}},
    {"type": "object", "additionalProperties": False, "properties": {}}, {"not": {}}, {"const": SURROGATE},
    {"type": "number", "multipleOf": 0}, {"type": "number", "exclusiveMinimum": Raw("1e309")},
    {"type": "number", "minimum": Raw("NaN")}, {"type": "integer", "maximum": Raw("1" + "0" * 400)},
    {"type": "string", "maxLength": Raw("-Infinity")},
    {"x-guidance": {"lenient": "yes"}}, {"x-guidance": {"whitespace_pattern": "["}}, {"properties": []},
    {"type": "object", "properties": {SURROGATE: {"type": "string"}}}, {"required": "a"}, {"enum": [SURROGATE]},
    {"type": "string", "pattern": SURROGATE}, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    True, False, [], "string",
]
REGEXES = ["[a-z]+", "(", ")", "[", "a{1000000}", "a{2,1}", "\\", "(?P<x>a)", "(?=a)", "(?<!a)b", "\\1", "\\p{L}",
           "\\d+", ".*", "^$", "", "a|", "*", "(?i)a", "[\ud800-\udfff]", SURROGATE, "\\ud800", "\\x00",
           "[^\\x00-\\x7f]", "(a*)*" * 20, "a" * 1000]
GRAMMARS = ['start: "a"', "start: x", "", "start:", "start: start", "start: /[/", "start: %json {}",
            'start: %json {"type": "object"}', "start: %json [", '%import common.WORD\nstart: WORD', "a: b\nb: a",
            'start: "' + SURROGATE + '"', "start: /" + SURROGATE + "/", 'start: "a"*', 'start: "a"{2,1}',
            "start: %llguidance {}", "%ignore x\nstart: x", 'start: "x" -> y', "?start: /a/ | start",
            'start: %json {"$ref": "#"}', "start: " + " ".join(f"r{i}" for i in range(200))]
SEMANTIC: dict[str, list] = {
    "model": [MODEL, MODEL + ":latest", MODEL + ":7b", "other", "", SURROGATE, MODEL + "\ud800", "TINY"],
    "name": ["get_weather", "other", "", SURROGATE, "a b", "<tool_call>", "get_weather\ud800", MODEL],
    "role": ["user", "assistant", "system", "tool", "developer", "function", "ipython", "", SURROGATE],
    "type": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document", "function",
             "json_object", "json_schema", "auto", "any", "tool", "none", "enabled", "disabled", "adaptive",
             "custom", "bash_20250124", "object", "", SURROGATE],
    "tool_choice": ["auto", "none", "required", "any", {"type": "function", "function": {"name": "get_weather"}},
                    {"type": "function", "function": "get_weather"}, {"type": "function"}, {"type": "any"},
                    {"type": "tool", "name": "get_weather"}, {"type": "tool"}, {"type": "auto"}, {"type": "none"},
                    {"type": "function", "function": {"name": "missing"}}, {"type": "tool", "name": "missing"},
                    {"type": "function", "function": {"name": SURROGATE}}, {"type": "function", "function": [1]}],
    "format": ["json", "", "xml", SCHEMA, *SCHEMAS],
    "think": [True, False, "low", "medium", "high", "max", "", "on"],
    "reasoning": ["on", "off", "auto", "high", {"enabled": True}, {"effort": "high"}, {"effort": "none"},
                  {"max_tokens": 0}, {"max_tokens": -1}, {"x": 1}, {"enabled": "yes"}],
    "reasoning_effort": ["none", "minimal", "low", "high", "max", "extreme"],
    "thinking": [{"type": "enabled", "budget_tokens": 10}, {"type": "disabled"}, {"type": "adaptive"},
                 {"type": "enabled", "display": "omitted"}, {"type": "enabled", "budget_tokens": 0},
                 {"type": "enabled", "display": "full"}, {"type": "x"}, {"budget_tokens": 5}, "hm"],
    "drafter": ["auto", "pld", "draft", "mtp", "assistant", "dflash", "none", "x", SURROGATE],
    "depth": [1, 16, 17, 0, -1, 2.0], "tree": ["auto", 0, 32, 33, -1, "x"], "enabled": [True, False],
    "stop": ["\n", "", ["a", "b"], ["a"] * 5, ["a" * 300], [SURROGATE], [""], ["<|im_end|>"]],
    "stop_sequences": [["\n"], [""], ["x"] * 33, ["x" * 257], [SURROGATE], ["<|im_end|>", " "]],
    "arguments": ['{"city": "Paris"}', "{", "[1]", "null", '"x"', "Infinity", "NaN", "1e309", '{"a": NaN}',
                  '{"a": 1e309}', '{"a": "\\ud800"}', '{"\\udfff": 1}', "", " ", "{}", '{"a": ' * 5,
                  '{"a": ' + "1" * 5000 + "}", '{"a": ' + "1" * 400 + "}", {"city": 1},
                  [], "x" * 100],
    "input": [{"city": "Paris"}, {}, [], "x", None, 1, {"a": {"b": [SURROGATE]}}],
    "input_schema": SCHEMAS, "parameters": SCHEMAS, "schema": SCHEMAS,
    "guided_json": SCHEMAS + ["{", "[]", '{"type": "string", "maxLength": ' + "9" * 5000 + "}"],
    "guided_regex": REGEXES, "guided_grammar": GRAMMARS,
    "prompt": ["x", "", " ", [1, 2], [], [-1], [10**10], [2**64], [1.5], ["a"], [True], "<|im_end|>" * 3],
    "logit_bias": [{"1": 5}, {"-1": 1}, {"99999999": 1}, {"x": 1}, {"1e3": 1}, {"1" * 5000: 1}, {"\u0661": 1},
                   {" 1": 1}, {"1_0": 1}, {"1": 101}, {"1": Raw("NaN")}, {"2047": -100}, {"2048": 1}],
    "logprobs": [True, False, 0, 2, 20, 21, -1], "top_logprobs": [0, 2, 20, 21, -1, True],
    "seed": [0, -1, 2**63 - 1, 2**63, 2**64],
    "max_tokens": [1, 2, 4, 5, 0, -1, 2**63, 10**30], "max_completion_tokens": [1, 4, 5, 0, -1],
    "num_predict": [1, 2, 4, 5, 0, -1, -2, -3, 2.0, 2.5, 2**63],
    "keep_alive": [0, "0", "5m", -1, "x"],
    "temperature": [0, 0.7, 1, 2, 2.1, 1e4, 1e5, -0.1], "top_p": [1, 0.5, 1e-9, 1e-10, 0, 1.1],
    "top_k": [0, 1, 40, -1, 2**63], "min_p": [0, 0.5, 1, 1.5],
    "repeat_last_n": [-1, 0, 8, -2, 2**30], "repetition_context_size": [1, 0, 2**24, 2**24 + 1, 2**63],
    "repeat_penalty": [1, 1.1, 0, -1], "repetition_penalty": [1, 1.1, 0, -1],
    "presence_penalty": [0, 2, 2.1, -2.1], "frequency_penalty": [0, 2, 2.1, -2.1],
    "mirostat": [0, 1, 2], "typical_p": [1.0, 0.5], "tfs_z": [1.0, 0.9],
    "content": ["hi", "", [{"type": "text", "text": "x"}], [{"type": "image_url", "image_url": {"url": "x"}}],
                [{"type": "text"}], [{"type": "text", "text": 1}], [{"type": "tool_use", "id": "t", "name": "f",
                                                                      "input": {}}],
                [{"type": "tool_result", "tool_use_id": "t", "content": "r"}], [{"text": "x"}], ["x"], [1]],
    "system": ["sys", "", [{"type": "text", "text": "s"}], [{"type": "image"}], [{"type": "text"}]],
    "tool_calls": [[CALL], [], [{}], [{"function": {"name": "f"}}], [{"function": "f"}],
                   [{"function": {"name": "f", "arguments": 1}}], [{"id": 1, "function": {"name": "f"}}], ["x"]],
    "tools": [[FN], [TOOL], [], [{}], [{"type": "function"}], [{"function": {"parameters": {}}}],
              [{"name": "f", "type": "web_search_20250305"}], [{"type": "function", "function": {"name": ""}}]],
    "images": [["aGk="], [], None],
    "context": [[1, 2], [], None],
    "chat_template_kwargs": [{"enable_thinking": True}, {"tools": []}, {"add_generation_prompt": False},
                             {SURROGATE: 1}, {"x": deep(50)}, {}],
    "response_format": [{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"schema": "x"}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                        {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}, {"type": "xml"}],
    "speculation": [{"drafter": "pld"}, {"enabled": False}, {"depth": 16, "tree": "auto"}, {"x": 1}, {}],
    "stream": [True, False], "echo": [True, False], "raw": [True, False], "n": [1, 2, 0],
    "best_of": [1, 2], "parallel_tool_calls": [True, False], "disable_parallel_tool_use": [True, False],
    "budget_tokens": [1, 0, -1, 2**63], "display": ["summarized", "omitted", "x"],
    "is_error": [True, False], "strict": [True, False], "modalities": [["text"], ["audio"], []],
    "include_usage": [True, False],
    "verbose": [True, False],
}
FIELD_NAMES = sorted(SEMANTIC) + ["options", "messages", "tool_call_id", "tool_use_id", "id", "metadata", "user",
                                  "stream_options", "json_schema", "suffix", "template", "reasoning_content",
                                  "num_ctx", "penalize_newline", "signature", "data", "description", "required",
                                  "properties", "items", "$ref", "x-guidance", "store", "service_tier"]


def json_texts(rng: random.Random) -> str:
    """A string field's JSON text: deeply nested, broken or odd."""
    if rng.random() < 0.5:
        return deep_json_text(rng)
    return rng.choice(SEMANTIC["arguments"][:16] + [json.dumps(rng.choice(SCHEMAS))])


def a_value(rng: random.Random, key) -> object:
    """Something to put where KEY (a field name, or a list index) was."""
    roll = rng.random()
    if isinstance(key, str) and key in SEMANTIC and roll < 0.45:
        return copy.deepcopy(rng.choice(SEMANTIC[key]))
    if roll < 0.55:
        return rng.choice([deep(rng.randint(101, 600), rng.choice(["list", "dict", "mixed"])),
                           deep(rng.randint(20, 90), rng.choice(["list", "dict", "mixed"])),
                           deep_schema(rng.choice([10, 45, 60, 300]))])
    if roll < 0.62:
        return json_texts(rng)
    return copy.deepcopy(rng.choice(other_values()))


@dataclass
class Case:
    path: str
    number: int
    content: bytes
    content_type: str | None = "application/json"
    mutations: tuple[str, ...] = ()

    def describe(self, limit: int = 600) -> str:
        text = self.content.decode("utf-8", "backslashreplace")
        cut = text if len(text) <= limit else text[: limit // 2] + f" ...({len(text)} bytes)... " + text[-limit // 2:]
        return f"POST {self.path} case {self.number} [{', '.join(self.mutations)}]: {cut}"


def sites(body) -> list[tuple[object, object]]:
    """(container, key) of every value in BODY down to a bounded depth (iterative: a mutation
    may have put something 600 deep there)."""
    out, pending = [], [(body, 0)]
    while pending:
        value, depth = pending.pop()
        if depth > 12:
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            out.append((value, key))
            if isinstance(item, (dict, list)):
                pending.append((item, depth + 1))
    return out


def mutate(rng: random.Random, body: dict) -> list[str]:
    """Mutate BODY in place, one to three times; what was done, for the failure message."""
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        places = sites(body)
        if not places:
            break
        container, key = rng.choice(places)
        op = rng.choices(["value", "surrogate", "delete", "add", "rekey", "wrap", "grow"],
                         [40, 18, 12, 10, 8, 6, 6])[0]
        value = container[key]
        if op == "value" and isinstance(value, (int, float)) and not isinstance(value, bool) and rng.random() < 0.5:
            op, container[key] = "number", copy.deepcopy(rng.choice(NUMBERS))  # where a number was: another
        elif op == "value":
            container[key] = a_value(rng, key)
        elif op == "surrogate":
            if isinstance(value, str):
                container[key] = surrogated(rng, value)
            elif isinstance(value, dict) and value:
                op = "surrogate key"
                k = rng.choice(list(value))
                value[surrogated(rng, k)] = value.pop(k)
            else:
                container[key] = surrogated(rng, "text")
        elif op == "delete":
            del container[key]
        elif op == "add":
            target = value if isinstance(value, dict) else container if isinstance(container, dict) else body
            name = rng.choice(FIELD_NAMES + ["unknown_field", "", SURROGATE, "__proto__", "Model", "a" * 200])
            target[name] = a_value(rng, name)
            key = name
        elif op == "rekey" and isinstance(container, dict):
            new = rng.choice([surrogated(rng, key), key.upper(), key + "s", key[:-1], "", rng.choice(FIELD_NAMES)])
            container[new] = container.pop(key)
        elif op == "wrap":
            container[key] = rng.choice([[value], {"k": value}, {"type": "text", "text": value}])
        elif op == "grow" and isinstance(value, list):
            # the same element again (shared, not copied: it may nest 600 deep), or new ones
            value.extend(rng.choice(value) if value and rng.random() < 0.7 else a_value(rng, key)
                         for _ in range(rng.randint(1, 40)))
        else:
            container[key] = a_value(rng, key)
            op = "value"
        done.append(f"{op} {key!r}"[:60])
    return done


def _with_deep_place(rng: random.Random, path: str, body: dict, turn: int) -> str:
    """Put deep nesting where the first fuzzer found it broke the server: tools, tool-call
    arguments (an object, or JSON text), tool_use input, input_schema, response schemas; TURN
    picks the place (each in turn)."""
    n = rng.choice([101, 150, 300, 500, 600]) if rng.random() < 0.7 else rng.randint(40, 95)
    nested = deep(n, rng.choice(["list", "dict", "mixed"]))
    if path in ("/v1/chat/completions", "/api/chat"):
        place = ["tools", "arguments", "arguments text", "schema", "other"][turn % 5]
        if place == "tools":
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"properties": nested}}}]
        elif place.startswith("arguments"):
            args = json.dumps({"a": nested}) if place == "arguments text" else {"a": nested}
            if place == "arguments text" and rng.random() < 0.3:  # or JSON text of another oddity
                args, place = rng.choice(SEMANTIC["arguments"][1:18]), "odd arguments text"
            body["messages"] = [dict(USER), {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}]
        elif place == "schema" and path == "/v1/chat/completions":
            place = rng.choice(["response_format", "guided_json", "guided_json text"])
            schema = {"type": "object", "properties": {"a": nested}}
            if place == "response_format":
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            else:
                body["guided_json"] = json.dumps(schema) if place.endswith("text") else schema
        elif place == "schema":
            place = "format"
            body["format"] = {"type": "object", "properties": {"a": nested}}
        else:
            place = "options" if path == "/api/chat" else "chat_template_kwargs"
            body[place] = {"x": nested}
    elif path.startswith("/v1/messages"):
        place = ["input_schema", "tool_use.input", "system"][turn % 3]
        if place == "input_schema":
            body["tools"] = [{"name": "f", "input_schema": {"type": "object", "properties": {"a": nested}}}]
        elif place == "tool_use.input":
            body["messages"] = [dict(USER), {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "f", "input": {"a": nested}}]}]
        else:
            body["system"] = [{"type": "text", "text": "s", "cache_control": nested}]
    elif path == "/v1/completions":
        place = rng.choice(["guided_json", "guided_json text", "response_format", "logit_bias", "prompt"])
        body[place.split()[0]] = json.dumps(nested) if place.endswith("text") else nested
    else:
        place = rng.choice(["format", "options", "prompt", "context", "model"])
        body[place] = nested
    return f"deep {n} at {place}"


def _with_surrogate_place(rng: random.Random, path: str, body: dict, turn: int) -> str:
    """Put a lone surrogate where the first fuzzer found one broke the server: the prompt, a
    regex or grammar, an assistant prefill, a raw prompt, and what an error message echoes back
    (the model name, keys, tool names), or in a stop string; TURN picks the place (each in turn)."""
    text = surrogated(rng, rng.choice(["", "a", "get_weather", "[a-z]+"]))
    places = {
        "/v1/chat/completions": ["model", "key", "stop", "tool name", "tool_choice name", "arguments", "guided_regex",
                                 "guided_grammar", "content", "guided_json"],
        "/v1/completions": ["model", "key", "prompt", "stop", "guided_regex", "guided_grammar", "logit_bias key"],
        "/v1/messages": ["model", "key", "stop_sequences", "tool name", "prefill", "system", "content",
                         "tool_choice name"],
        "/v1/messages/count_tokens": ["model", "key", "tool name", "prefill", "system", "tool_choice name"],
        "/api/chat": ["model", "key", "options key", "stop", "tool name", "arguments", "content", "format key"],
        "/api/generate": ["model", "key", "options key", "stop", "raw prompt", "system", "prompt"],
        "/api/show": ["model", "key", "name"],
        "/infill": ["model", "key", "stop", "input_prefix", "input_suffix", "prompt"],
        "/v1/responses": ["model", "key", "input", "instructions", "tool name", "content"],
    }[path]
    place = places[turn % len(places)]
    tool = {"type": "function", "function": {"name": text, "parameters": {"type": "object"}}}
    if place in ("model", "system", "prompt", "guided_regex", "guided_json", "name", "input", "instructions",
                 "input_prefix", "input_suffix"):
        body[place] = text
    elif place == "guided_grammar":
        body[place] = rng.choice([f'start: "{text}"', f"start: /{text}/", f"start: {text}"])
    elif place == "key":
        body[text] = 1
    elif place == "options key":
        body["options"] = {**(body.get("options") or {}), text: 1}
    elif place == "format key":
        body["format"] = {"type": "object", "properties": {text: {"type": "string"}}}
    elif place == "logit_bias key":
        body["logit_bias"] = {text: 1}
    elif place in ("stop", "stop_sequences"):
        stops = [text] if path.startswith("/v1/") or rng.random() < 0.5 else text
        if path.startswith("/api/"):
            body["options"] = {**(body.get("options") or {}), "stop": stops}
        else:
            body[place] = stops
    elif place == "raw prompt":
        body.update(prompt=text, raw=True)
    elif place == "tool name" and path.startswith("/v1/messages"):
        body["tools"] = [{"name": text, "input_schema": {"type": "object"}}]
    elif place == "tool name":
        body["tools"] = [tool]
        if path == "/v1/chat/completions" and rng.random() < 0.5:
            body["tool_choice"] = rng.choice(["required", {"type": "function", "function": {"name": text}}])
    elif place == "tool_choice name" and path.startswith("/v1/messages"):
        body.update(tools=[{"name": "get_weather"}], tool_choice={"type": "tool", "name": text})
    elif place == "tool_choice name":
        body.update(tools=[copy.deepcopy(FN)], tool_choice={"type": "function", "function": {"name": text}})
    elif place == "arguments":
        args = rng.choice([json.dumps({"city": text}), json.dumps({text: 1}), {"city": text}])
        body["messages"] = [dict(USER), {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": args}}]}]
    elif place == "prefill":
        body["messages"] = [dict(USER), {"role": "assistant", "content": rng.choice([text, [{"type": "text",
                                                                                        "text": text}]])}]
    else:  # content
        body["messages"] = [{"role": "user", "content": text}]
    return f"surrogate at {place}"


def _made_big(rng: random.Random, body: dict) -> str:
    """BODY over 256 KiB: a long list (validated in slices) or a long string."""
    if isinstance(body.get("messages"), list) and rng.random() < 0.7:
        body["messages"] = [dict(USER) for _ in range(rng.choice([2500, 4500]))]
        if rng.random() < 0.5:
            body["messages"][rng.randrange(len(body["messages"]))] = a_value(rng, "messages")
        return f"big: {len(body['messages'])} messages"
    key = rng.choice(["prompt", "system", "stop", "model", "unknown_field"])
    body[key] = "x " * 150_000
    return f"big: {key} 300 KB"


def _valid_combo(rng: random.Random, path: str, body: dict) -> str:
    """Valid values for many options at once (sampling at its bounds, penalties, logit_bias,
    speculation, logprobs, a constraint, stop strings): combinations that reach the engine."""
    spec = {k: v for k, v in (("drafter", rng.choice(["auto", "pld", "none"])), ("depth", rng.randint(1, 16)),
                              ("tree", rng.choice(["auto", 0, 1, 4, 8, 32])), ("enabled", rng.random() < 0.8))
            if rng.random() < 0.6}
    stops = [rng.choice([" ", "e", "\n", "a", "<", "def", "ing", "x" * 256]) for _ in range(rng.randint(0, 4))]
    bias = {str(rng.randrange(2048)): rng.choice([-100, -1, 1, 100]) for _ in range(rng.randint(0, 3))}
    sampling = {"temperature": rng.choice([0, 1e-9, 0.5, 1]), "top_p": rng.choice([1e-9, 0.1, 0.9, 1]),
                "top_k": rng.choice([0, 1, 5, 2048, 10**6]), "seed": rng.randrange(2**63)}
    penalties = {"presence_penalty": rng.uniform(-2, 2), "frequency_penalty": rng.uniform(-2, 2)}
    regex, grammar = rng.choice(["[a-z]{1,3}", "(yes|no)", "\\d+", ".", "[^x]*"]), 'start: "a" | "b" start'
    schema = copy.deepcopy(rng.choice([SCHEMA, {"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                       {"enum": ["a", "b"]}]))
    if path in ("/v1/chat/completions", "/v1/completions"):
        body.update(sampling, **penalties, speculation=spec, stream=rng.random() < 0.5,
                    repetition_penalty=rng.choice([0.5, 1, 1.5, 100]),
                    repetition_context_size=rng.choice([1, 16, 2**24]), logit_bias=bias, stop=stops,
                    temperature=rng.choice([0, 1e-9, 0.5, 1, 2]), min_p=rng.choice([0, 0.5, 1]))
        body["stream_options"] = {"include_usage": True} if body["stream"] and rng.random() < 0.5 else None
        constraint = rng.choice([None, "response_format", "guided_json", "guided_regex", "guided_grammar"])
        if constraint is not None:  # the one constraint (a base body may have another)
            for field in ("response_format", "guided_json", "guided_regex", "guided_grammar", "tool_choice"):
                body.pop(field, None)
            body[constraint] = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
                                "guided_json": schema, "guided_regex": regex, "guided_grammar": grammar}[constraint]
        if path == "/v1/completions":
            body.update(logprobs=rng.choice([None, 0, 5, 20]), echo=rng.random() < 0.5)
        else:
            top = rng.choice([None, 0, 5, 20])
            body.update(logprobs=top is not None or rng.random() < 0.3, top_logprobs=top)
    elif path.startswith("/v1/messages"):
        body.update(temperature=rng.choice([0, 0.5, 1]), top_p=sampling["top_p"], top_k=sampling["top_k"],
                    stop_sequences=stops, speculation=spec, stream=rng.random() < 0.5)
    elif path.startswith("/api/"):
        body["options"] = {**sampling, **penalties, "num_predict": rng.choice([1, 4, -1, -2]), "stop": stops,
                           "repeat_penalty": rng.choice([0.5, 1, 1.5]), "repeat_last_n": rng.choice([-1, 0, 1, 64]),
                           "min_p": rng.choice([0, 0.5])}
        body.update(format=rng.choice([None, "json", schema]), stream=rng.random() < 0.5, speculation=spec)
        if body["format"] is not None:
            body["think"] = False
        top = rng.choice([None, 0, 5, 20])
        body.update(logprobs=top is not None or rng.random() < 0.3, top_logprobs=top)
    return "valid combination"


BROKEN_BYTES = [
    lambda raw: raw[: len(raw) // 2],  # cut short
    lambda raw: raw + b"}",  # trailing garbage
    lambda raw: b"\xef\xbb\xbf" + raw,  # a byte-order mark
    lambda raw: raw.replace(b'"', b'"\xff', 1),  # not UTF-8
    lambda raw: raw.replace(b'": "', b'": "\xed\xa0\x80', 1),  # a surrogate's raw UTF-8 bytes
    lambda raw: raw.decode().encode("utf-16"),  # JSON in UTF-16 (Python's json reads it)
    lambda raw: raw.decode().encode("utf-16-le").replace(b"\x00:\x00 \x00\"\x00", b"\x00:\x00 \x00\"\x00\x00\xd8", 1),
    lambda raw: raw.decode().encode("utf-32"),
    lambda raw: b"",
    lambda raw: b"null",
    lambda raw: b"[" + raw + b"]",
    lambda raw: b'"' + raw.replace(b'"', b"'") + b'"',
    lambda raw: b"1e309",
    lambda raw: raw.replace(b"{", b'{"a": 1, "a": 2, ', 1),  # a duplicate key
    lambda raw: raw[:-1] + b', "' + b"k" * 5000 + b'": ' + b"[" * 99 + b"]" * 99 + b"}",
    lambda raw: b"{" * 200_000,
]


def body_for(seed: int, path: str, number: int) -> Case:
    """Case NUMBER of route PATH under SEED: a base body of the route, mutated."""
    rng = random.Random(f"{seed}/{path}/{number}")
    body = copy.deepcopy(rng.choice(ROUTES[path]))
    roll = rng.random()
    if number % 8 == 3:  # every place in turn: a case in 8, so each is reached within 80 cases
        mutations = [_with_surrogate_place(rng, path, body, number // 8)]
    elif number % 8 == 7:
        mutations = [_with_deep_place(rng, path, body, number // 8)]
    elif roll < 0.07:  # a body left valid: it must be served
        mutations = ["none"]
    elif roll < 0.2:
        mutations = [_valid_combo(rng, path, body)]
    else:
        mutations = []
    if not mutations or mutations != ["none"] and rng.random() < 0.2:
        mutations += mutate(rng, body)
    if rng.random() < 0.015:  # past PARSE_OFF_LOOP_BYTES (256 KiB): parsed and validated on a thread
        mutations.append(_made_big(rng, body))
    raw = dumps(body).encode("utf-8")
    content_type = "application/json"
    roll = rng.random()
    if roll < 0.06:
        i = rng.randrange(len(BROKEN_BYTES))
        raw, mutations = BROKEN_BYTES[i](raw), mutations + [f"bytes {i}"]
    elif roll < 0.09:
        content_type = rng.choice([None, "text/plain", "application/x-www-form-urlencoded", "application/json; x",
                                   "application/vnd.api+json", "multipart/form-data"])
        mutations = mutations + [f"content-type {content_type}"]
    return Case(path, number, raw, content_type, tuple(mutations))
