"""Check relative Markdown links `](path#anchor)` in README.md and docs/*.md: the file exists and
the anchor matches a heading (GitHub slugs)."""
import re
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def strip_code(text):
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return text


def slugs(path):
    out, seen = set(), {}
    for line in strip_code(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = m.group(1).strip().lower()
        s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", s)  # link text only
        s = re.sub(r"[^\w\- ]", "", s).replace(" ", "-")
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


bad, count = [], 0
for f in files:
    text = strip_code(f.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        count += 1
        path, _, anchor = target.partition("#")
        dest = (f.parent / path).resolve() if path else f
        if not dest.exists():
            bad.append(f"{f.relative_to(root)}: {target}: no file {path}")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            bad.append(f"{f.relative_to(root)}: {target}: no heading #{anchor} in {dest.relative_to(root)}")
print(f"{count} relative links checked in {len(files)} files, {len(bad)} broken")
print("\n".join(bad))
sys.exit(1 if bad else 0)
