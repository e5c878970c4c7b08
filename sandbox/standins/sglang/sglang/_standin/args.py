"""The real sglang 0.5.9 server's command line, rebuilt from server_args.json.

server_args.json is locks/sglang-0.5.9.args.json, embedded when the stand-in wheel is built:
{"package", "version", "source", "arguments": [{"flags", "dest", "action", "type", "choices",
"nargs", "required", "default"}, ...]}, read out of the real wheel's server_args.py.
"""

import argparse
import json
import os
import sys

ARGS_FILE = os.path.join(os.path.dirname(__file__), "server_args.json")

# ServerArgs.from_cli_args: argparse dests that ServerArgs holds under another name
RENAMED = {
    "tensor_parallel_size": "tp_size",
    "pipeline_parallel_size": "pp_size",
    "attention_context_parallel_size": "attn_cp_size",
    "moe_data_parallel_size": "moe_dp_size",
    "data_parallel_size": "dp_size",
    "expert_parallel_size": "ep_size",
}


def nullable_str(val):
    if not val or val == "None":
        return None
    return val


def json_list_type(value):
    try:
        return json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"Invalid JSON list: {value}. Please provide a valid JSON list."
        ) from None


TYPES = {
    "str": str,
    "int": int,
    "float": float,
    "nullable_str": nullable_str,
    "json": json.loads,
    "json_list_type": json_list_type,
}


class DeprecatedAction(argparse.Action):
    def __init__(self, option_strings, dest, nargs=0, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"The command line argument '{option_string}' is deprecated and will be removed "
            "in future versions.",
            file=sys.stderr,
        )


def load_spec(path=ARGS_FILE):
    with open(path) as fh:
        return json.load(fh)


def build_parser(spec):
    """An ArgumentParser taking exactly the flags of the real server (sglang's own parser is a
    plain ArgumentParser, so abbreviations such as --tp work as they do there)."""
    parser = argparse.ArgumentParser()
    for arg in spec["arguments"]:
        action = arg.get("action") or "store"
        kwargs = {"dest": arg["dest"], "default": arg.get("default")}
        if action in ("store_true", "store_false"):
            kwargs["action"] = action
        elif action == "count":
            kwargs["action"] = "count"
        elif action in ("store_const", "append_const"):
            kwargs.update(action=action, const=arg.get("const", True))
        elif action == "DeprecatedAction":
            kwargs["action"] = DeprecatedAction
        else:  # store, append, extend, and custom actions that store what they are given
            if action in ("append", "extend"):
                kwargs["action"] = action
            if arg.get("type"):
                kwargs["type"] = TYPES.get(arg["type"], str)
            if arg.get("choices") is not None:
                kwargs["choices"] = arg["choices"]
            if arg.get("nargs") is not None:
                kwargs["nargs"] = arg["nargs"]
            if arg.get("required"):
                kwargs["required"] = True
        parser.add_argument(*arg["flags"], **kwargs)
    return parser


def server_args(namespace):
    """The ServerArgs fields as a dict: renamed dests, and the defaults __post_init__ fills."""
    args = {RENAMED.get(k, k): v for k, v in vars(namespace).items()}
    if args.get("tokenizer_path") is None:
        args["tokenizer_path"] = args.get("model_path")
    if args.get("served_model_name") is None:
        args["served_model_name"] = args.get("model_path")
    return args
