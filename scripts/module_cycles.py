#!/usr/bin/env python3
"""Import circles between the modules of each library crate (scripts/check_layout.sh runs it).

A module is a source file. Module A imports B when A names a path (`crate::...`, `super::...`,
`self::...`) that resolves to B, or to an item that a parent module re-exports from B
(`pub use b::Item`). Edges to a module's own ancestors or descendants are left out: a parent
that declares and re-exports its children is how Rust modules are built, not a circle. Prints
each circle found (its modules in order) and exits 1 if there is one; `--list` prints them and
exits 0.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)(::\{([^;]*?)\})?")
REEXPORT = re.compile(r"^\s*pub(?:\([a-z]+\))? use ([a-z_][A-Za-z0-9_:]*?)(?:::\{([^;]*)\}|::([A-Za-z_][A-Za-z0-9_]*))(?: as [A-Za-z_0-9]+)?;", re.M | re.S)


def strip_comments(text):
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'r#*"(?:.|\n)*?"#*', '""', text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def module_files(src):
    """Module path (tuple) -> file, for one crate's src/."""
    modules = {}
    for f in src.rglob("*.rs"):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] in ("lib", "main", "mod"):
            parts = parts[:-1]
        modules[tuple(parts)] = f
    return modules


def resolve(modules, reexports, base, segments):
    """The module a path from `base` through `segments` lands in (the deepest one named)."""
    current = base
    for i, name in enumerate(segments):
        child = current + (name,)
        if child in modules:
            current = child
            continue
        target = reexports.get((current, name))
        return target if target is not None else current
    return current


def absolute(module, root, tail):
    if root == "crate":
        return (), tail
    if root == "self":
        return module, tail
    base = module
    while tail and tail[0] == "super":
        tail = tail[1:]
        base = base[:-1]
    return base[:-1], tail


def crate_graph(src):
    modules = module_files(src)
    texts = {m: strip_comments(f.read_text()) for m, f in modules.items()}
    # Items a module re-exports, mapped to the module that defines them (two passes reach
    # re-exports of re-exports).
    reexports = {}
    for _ in range(2):
        for module, text in texts.items():
            for m in REEXPORT.finditer(text):
                path, group, single = m.group(1), m.group(2), m.group(3)
                segments = path.split("::")
                if segments[0] in ("crate", "super", "self"):
                    base, tail = absolute(module, segments[0], segments[1:])
                elif module + (segments[0],) in modules:
                    base, tail = module, segments
                else:
                    continue  # another crate's items
                target = resolve(modules, reexports, base, tail)
                names = [single] if single else [n.strip().split(" as ")[-1] for n in group.split(",")]
                for name in names:
                    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name or ""):
                        reexports[(module, name)] = target
    edges = {m: set() for m in modules}
    for module, text in texts.items():
        for m in PATH.finditer(text):
            root, tail = m.group(1), m.group(2).split("::")[1:]
            base, rest = absolute(module, root, tail)
            targets = [resolve(modules, reexports, base, rest)]
            if m.group(4):
                for item in m.group(4).split(","):
                    item = item.strip().split(" as ")[0].split("::")
                    if item and item[0] and item[0] != "self":
                        targets.append(resolve(modules, reexports, targets[0], [s for s in item if s]))
            for target in targets:
                related = target[: len(module)] == module or module[: len(target)] == target
                if not related:
                    edges[module].add(target)
    return edges


def cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main():
    found = []
    roots = [Path(a) for a in sys.argv[1:] if not a.startswith("--")] or [ROOT]
    for src in sorted(s for r in roots for s in r.glob("lib/*/src")):
        for component in cycles(crate_graph(src)):
            names = ", ".join("::".join(m) or "(crate root)" for m in component)
            found.append(f"{src.parent.name}: {names}")
    for line in found:
        print(f"import circle in {line}")
    if found and "--list" not in sys.argv:
        sys.exit(1)


if __name__ == "__main__":
    main()
