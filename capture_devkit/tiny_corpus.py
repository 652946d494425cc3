"""Deterministic training text for the tiny model's tokenizer.

The text only has to make prompts tokenize compactly: English-ish prose, JSON (tool schemas and
arguments), code, shell commands and chat/tool-call markup. It is generated from a fixed seed with
:class:`random.Random`, whose integer and choice streams are stable across Python versions, so the
tokenizer trained on it is the same on every run.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

_WORD_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by not word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing
course stay wheel full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape
equate miss brought heat snow tire bring yes distant fill east paint language among
agent assistant user system tool tools file files directory path command output input error
errors task subagent session context summary result results function arguments parameter
parameters description required optional string integer boolean number object array null true
false type properties items enum default value values content message messages role response
request model token tokens prompt completion code project repository branch commit test tests
build install run server client config configuration option options search read write edit
replace patch diff line lines text pattern glob grep bash shell todo list update create delete
return import class def self async await yield lambda print format json schema http https url
api key header headers status episode reward training policy gradient loss batch sample answer
instructions important always never must should concise explain user's codebase workspace
"""
WORDS = _WORD_TEXT.split()

KEYS = [
    "name",
    "description",
    "type",
    "properties",
    "required",
    "items",
    "enum",
    "default",
    "command",
    "path",
    "filePath",
    "content",
    "pattern",
    "query",
    "url",
    "timeout",
    "limit",
    "offset",
    "oldString",
    "newString",
    "replaceAll",
    "include",
    "prompt",
    "subagent_type",
    "todos",
    "id",
    "status",
    "priority",
    "arguments",
    "role",
    "tool_call_id",
    "workdir",
]
TOOL_NAMES = [
    "bash",
    "read",
    "write",
    "edit",
    "glob",
    "grep",
    "list",
    "task",
    "webfetch",
    "todowrite",
    "todoread",
    "patch",
    "search",
    "get_weather",
    "lookup",
    "calculator",
]
CODE_LINES = [
    "def {a}({b}, {c}):",
    "    return {a}({b}) + {c}",
    "for {a} in range({n}):",
    "    if {a} is None:",
    '        raise ValueError("{a} {b}")',
    "import {a}",
    "from {a} import {b}",
    "class {A}({B}):",
    "    self.{a} = {b}",
    "const {a} = await {b}.{c}({n});",
    "export function {a}({b}) {{",
    "  return {b}.map(({c}) => {c}.{a});",
    "}}",
    "$ {a} --{b} {c}",
    "ls -la {a}/",
    "cd {a} && git status",
    "cat {a}.py | grep {b}",
    "    {a}: list[{A}] = []",
    "    assert {a} == {n}",
    "// {a} {b} {c}",
    "# {a} {b} {c}",
    "{a}.{b}({c}=True)",
    'print(f"{{{a}}} {b}")',
    '  "{a}": "{b}",',
    "    }}",
    "    ]",
]
PUNCT = [".", ".", ".", ",", ",", "?", "!", ":", ";"]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
    words[0] = words[0].capitalize()
    parts = []
    for word in words:
        parts.append(word)
        if rng.random() < 0.08:
            parts[-1] += rng.choice(PUNCT[3:])
    return " ".join(parts) + rng.choice([*PUNCT[:3], "?", "!"])


def _prose(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(1, 6)))


def _json_value(rng: random.Random, depth: int) -> object:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-1000, 100000)
    if kind == 1:
        return rng.choice([True, False, None])
    if kind in (2, 3):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
    if kind == 4:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(KEYS): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}


def _tool_schema(rng: random.Random) -> dict[str, object]:
    props = {
        key: {
            "type": rng.choice(["string", "integer", "boolean", "number"]),
            "description": _sentence(rng),
        }
        for key in rng.sample(KEYS, rng.randint(1, 4))
    }
    return {
        "type": "function",
        "function": {
            "name": rng.choice(TOOL_NAMES),
            "description": _prose(rng),
            "parameters": {
                "type": "object",
                "properties": props,
                "required": sorted(props)[:1],
                "additionalProperties": False,
            },
        },
    }


def _code(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(2, 10)):
        a, b, c = (rng.choice(WORDS) for _ in range(3))
        lines.append(
            rng.choice(CODE_LINES).format(
                a=a, b=b, c=c, A=a.capitalize(), B=b.capitalize(), n=rng.randint(0, 512)
            )
        )
    return "\n".join(lines)


def _chat(rng: random.Random) -> str:
    """Chat markup without the added tokens themselves (they never reach the BPE)."""
    call = {
        "name": rng.choice(TOOL_NAMES),
        "arguments": {rng.choice(KEYS): _json_value(rng, 2) for _ in range(rng.randint(1, 3))},
    }
    tools = "\n".join(json.dumps(_tool_schema(rng)) for _ in range(rng.randint(1, 3)))
    return (
        f"system\n{_prose(rng)}\n\n# Tools\n\n<tools>\n{tools}\n</tools>\n"
        f"user\n{_prose(rng)}\nassistant\n{_prose(rng)}\n\n{json.dumps(call)}\n\n"
        f"user\n\n{json.dumps(_json_value(rng, 1))}\n\nassistant\n{_prose(rng)}\n"
    )


def corpus(seed: int, n_samples: int) -> Iterator[str]:
    """Yield ``n_samples`` deterministic text samples of mixed kinds."""
    rng = random.Random(seed)
    makers = [
        _prose,
        _prose,
        _code,
        _chat,
        lambda r: json.dumps(_json_value(r, 0), indent=r.choice([None, 2])),
        lambda r: json.dumps(_tool_schema(r)),
    ]
    for _ in range(n_samples):
        yield rng.choice(makers)(rng)
