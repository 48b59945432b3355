"""The validation as ``fp4pass inspect`` prints it, and its exit status.

Every problem names the module or tensor, the consequence and the fix; ``engines`` lists the engines it
affects (all when absent); ``severity`` is "error", or "warning" for a guess and for an engine that does not
load a correct form (unless that engine was asked for). Each engine's verdict says what it would do
(:data:`~fp4pass.checkpoint.validate.kinds.OUTCOMES`). Exit codes of ``fp4pass inspect`` (:func:`exit_status`):
0 no error, 1 errors (with ``--strict``, warnings too), 2 unreadable folder.
"""

from __future__ import annotations

__all__ = ["format_validation", "problem_line", "exit_status"]


def format_validation(info: dict) -> str:
    """A readable report of :func:`validate`'s result: the engine table (what each engine would do), the modules
    with their global and input scales and the convention they are stored in (a multiplier: W = e2m1 x
    block x g; a divisor: W = e2m1 x block / g), then the problems (errors) and the warnings."""
    lines = [f"{info['source']}: form {info['form']}" + (f" ({info['quant_algo']})" if info.get("quant_algo") else "")
             + f", {len(info['modules'])} quantized module(s) in {len(info['shards'])} shard(s), "
             f"layouts {', '.join(info['layouts']) or 'none'}, input scales {info['input_scales']}", ""]
    lines.append(f"{'engine':<8} {'outcome':<38} {'mode':<6} why")
    for name, v in info["engines"].items():
        outcome = v.get("outcome") or ("loads" if v.get("loads") else "does not load")
        lines.append(f"{name:<8} {outcome:<38} {str(v.get('mode') or '-'):<6} {v.get('why') or ''}")
    lines.append("")
    lines.extend(_module_lines(info["modules"]))
    errors = [p for p in info["problems"] if p.get("severity") != "warning"]
    warnings = [p for p in info["problems"] if p.get("severity") == "warning"]
    if not errors:
        lines.append("no problem found")
    else:
        lines.append(f"{len(errors)} problem(s):")
        lines.extend(problem_line(p) for p in errors)
    if warnings:
        lines.append(f"{len(warnings)} warning(s) (exit 0 unless --strict):")
        lines.extend(problem_line(p) for p in warnings)
    return "\n".join(lines)


def _module_lines(modules: list[dict], shown: int = 20) -> list[str]:
    """The first ``shown`` modules: layout, and global and input scales as stored, with their convention."""
    if not modules:
        return []

    def scale(m: dict, key: str) -> str:
        value = m.get(key)
        if value is None:
            return "-"
        number = f"{value:.6g}" if isinstance(value, float) else f"[{len(value)}]"
        return f"{number} {m.get('convention', '')}".rstrip()

    lines = [f"{'module':<60} {'layout':<14} {'global scale':>24} {'input scale':>24}"]
    for m in modules[:shown]:
        lines.append(f"{m['module']:<60} {m['layout']:<14} {scale(m, 'global_scale'):>24} "
                     f"{scale(m, 'input_scale'):>24}")
    if len(modules) > shown:
        lines.append(f"... {len(modules) - shown} more (--json lists all)")
    lines.append("")
    return lines


def problem_line(p: dict) -> str:
    who = f" [{', '.join(p['engines'])}]" if p.get("engines") else ""
    return f"  {p['kind']}{' (guess)' if p.get('guess') else ''}{who}: {p['message']}"


def exit_status(info: dict, strict: bool = False) -> int:
    """``fp4pass inspect``'s exit status for :func:`validate`'s result: 1 when a problem is an error (with
    ``strict``, a warning too), else 0."""
    return 1 if any(strict or p.get("severity") != "warning" for p in info["problems"]) else 0


#: kinds that, in a folder fp4pass itself wrote, can only come from a broken writer (exit 3); the others
