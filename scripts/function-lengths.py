#!/usr/bin/env python3
"""The longest functions of zoe's product code (C++ and Python), and a check of their limit.

    scripts/function-lengths.py [--max N] [--top K] [PATH ...]

Lists the K longest functions (lines from the signature to the closing brace or the last line of
the body) below PATH (default: the product folders: core, io, optim, offload, reliability,
integrations; tests and benchmarks excluded) and exits 1 when one is longer than N (default 60).
C++ functions are found by matching braces after comments and literals are blanked: a block
opened after a parenthesised parameter list that does not follow a control keyword is a
function, and a lambda counts toward the function that holds it. Python functions come from the
ast module; a nested function counts toward its enclosing one too.
"""

import argparse
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ["core", "io", "optim", "offload", "reliability", "integrations"]
EXCLUDED_PARTS = {"tests", "bench", "build", "__pycache__"}
CONTROL = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype", "alignas"}
CPP_SUFFIXES = (".cc", ".h", ".cu", ".cpp")


def blank_comments_and_literals(text):
    """``text`` with comments, string and character literals replaced by spaces, newlines kept."""
    pattern = re.compile(
        r'//[^\n]*|/\*.*?\*/|R"(?P<delim>[^(\s]*)\(.*?\)(?P=delim)"|"(?:\\.|[^"\\\n])*"'
        r"|'(?:\\.|[^'\\\n])*'",
        re.S,
    )
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def opens_function(head):
    """Whether the text before a '{' (since the previous ';', '{' or '}') is a function header."""
    head = " ".join(head.split())
    if not head or head.startswith("#"):
        return False
    head = re.sub(r"\s*:\s*[\w:<>]+\s*[({].*$", "", head) if ") :" in head else head
    match = re.search(r"\)\s*((const|noexcept|override|final|mutable|&|&&)\s*)*(->\s*[\w:<>*&\s]+)?$",
                      head)
    if not match:
        return False
    name = re.search(r"([~\w:]+|operator\S+)\s*\($", head[: head.index("(")] + "(") if "(" in head else None
    if name is None:
        return False
    word = name.group(1).split("::")[-1]
    return word not in CONTROL and not head.lstrip().startswith("[")


def cpp_functions(path):
    """[(lines, first line, name)] of the functions defined in the C++ file ``path``."""
    text = blank_comments_and_literals(open(path, encoding="utf-8", errors="replace").read())
    found = []
    depth = 0
    function_depth = None
    start = 0
    head_start = 0
    name = ""
    for index, char in enumerate(text):
        if char in ";}":
            if char == "}":
                depth -= 1
                if function_depth is not None and depth == function_depth:
                    end_line = text.count("\n", 0, index) + 1
                    found.append((end_line - start + 1, start, name))
                    function_depth = None
            head_start = index + 1
        elif char == "{":
            head = text[head_start:index]
            if function_depth is None and opens_function(head):
                function_depth = depth
                first = head_start + len(head) - len(head.lstrip())
                start = text.count("\n", 0, first) + 1
                name = " ".join(head[: head.index("(")].split()[-1:]) if "(" in head else "?"
            depth += 1
            head_start = index + 1
    return found


def python_functions(path):
    """[(lines, first line, name)] of the outermost functions and methods of ``path``."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.append((child.end_lineno - first + 1, first, prefix + child.name))
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return found


def product_files(paths):
    for top in paths:
        if os.path.isfile(top):
            yield top
            continue
        for folder, subfolders, files in os.walk(top):
            subfolders[:] = sorted(d for d in subfolders if d not in EXCLUDED_PARTS)
            for file in sorted(files):
                if file.endswith(CPP_SUFFIXES + (".py",)):
                    yield os.path.join(folder, file)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max", type=int, default=60)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("paths", nargs="*")
    args = parser.parse_args()
    paths = args.paths or [os.path.join(ROOT, p) for p in PRODUCT]
    rows = []
    for path in product_files(paths):
        functions = python_functions(path) if path.endswith(".py") else cpp_functions(path)
        rows += [(lines, os.path.relpath(path, ROOT), first, name) for lines, first, name in functions]
    rows.sort(reverse=True)
    for lines, path, first, name in rows[: args.top]:
        print(f"{lines:5d}  {path}:{first}  {name}")
    over = [row for row in rows if row[0] > args.max]
    print(f"{len(rows)} functions; {len(over)} longer than {args.max} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
