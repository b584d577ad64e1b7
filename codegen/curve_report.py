"""`zplan plan`'s curve as text, from the search's curve dict (planner.inverse.as_dict): the table's cells (curve.md
and the command's table), and the files of -o OUT: curve.json, curve.md and curve.svg. Deterministic: the same curve
gives the same bytes."""

from __future__ import annotations

import json

from zplan.codegen.curve_svg import curve_svg
from zplan.codegen.render import report_environment

NONE = "-"  # a cell with no value (no plan at that count, no interval, no price)
SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def days_text(value: float | None) -> str:
    """Days with the digits a deadline comparison needs: 2 decimals below 10 days, 1 below 100, none above."""
    if value is None:
        return NONE
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def interval_text(interval: list[float] | None) -> str:
    return NONE if interval is None else f"{days_text(interval[0])} - {days_text(interval[1])}"


def amount_text(value: float | None) -> str:
    """GPU-hours or money, whole units with thousands separators."""
    return NONE if value is None else f"{value:,.0f}"


def rate_text(value: float | None) -> str:
    """Tokens/s to 3 significant figures with an SI prefix, e.g. 1.58M."""
    if value is None:
        return NONE
    scale, prefix = next(((s, p) for s, p in SI if value >= s), (1.0, ""))
    return f"{value / scale:.3g}{prefix}"


def meets_text(row: dict) -> str:
    """Whether the count meets the deadline: its central prediction, and the 80 % interval's slow end."""
    if row["error"]:
        return row["error"] if row["error"].startswith("no plan") else f"no plan: {row['error']}"
    if not row["meets"]:
        return "no"
    slow = row["slow_end_meets"]
    return "yes" if slow is None or slow else "yes, slow end no"


def verdict(curve: dict, strong: str = "**") -> str:
    """A sentence or two on the chosen count, its days (interval) and cost; `strong` marks the answer (Markdown)."""
    chosen, deadline = curve["chosen"], curve["deadline_days"]
    if chosen is None:
        return f"No count up to {curve['max_gpus']} GPUs meets {deadline:g} days."
    cost = (f", {amount_text(chosen['cost'])} at {curve['price_per_gpu_hour']:g} per GPU-hour"
            if chosen["cost"] is not None else "")
    text = (f"{strong}Chosen: {chosen['gpus']} GPUs, {days_text(chosen['days'])} days{strong} "
            f"(global batch {chosen['global_batch']}, {chosen['layout']}), "
            f"{amount_text(chosen['gpu_hours'])} GPU-hours{cost}.")
    if chosen["days_interval"] is not None:
        slow = "also meets" if chosen["slow_end_meets"] else "misses"
        text += (f" The 80 % interval is {interval_text(chosen['days_interval'])} days: its slow end {slow} the "
                 f"{deadline:g}-day deadline.")
    cheapest = curve["cheapest"]
    if cheapest["gpus"] != chosen["gpus"]:
        cost = f", {amount_text(cheapest['cost'])}" if cheapest["cost"] is not None else ""
        text += (f" The cheapest evaluated count that meets it is {cheapest['gpus']} GPUs: "
                 f"{days_text(cheapest['days'])} days, {amount_text(cheapest['gpu_hours'])} GPU-hours{cost}.")
    if curve["non_monotone"]:
        text += (" Train time was not monotone over the counts evaluated (it rises from one to the next somewhere, "
                 "or a larger count has no plan).")
    return text


def table_rows(curve: dict) -> list[dict[str, str]]:
    """curve.json's rows as the table's cells (curve.md and the command's table)."""
    return [{"gpus": str(r["gpus"]), "global_batch": str(r["global_batch"]) if r["global_batch"] is not None else NONE,
             "layout": r["layout"] or NONE, "tokens_per_s": rate_text(r["tokens_per_s"]),
             "days": days_text(r["days"]), "interval": interval_text(r["days_interval"]),
             "gpu_hours": amount_text(r["gpu_hours"]), "cost": amount_text(r["cost"]), "meets": meets_text(r)}
            for r in curve["curve"]]


def curve_markdown(curve: dict) -> str:
    price = curve["price_per_gpu_hour"]
    days = curve["deadline_days"]
    budget = (f"{curve['tokens']:.3g} tokens on {curve['cluster']} within {days:g} day{'s' if days != 1 else ''}, "
              f"at most {curve['max_gpus']} GPUs.")
    return report_environment().get_template("curve.md.j2").render(
        model=curve["model"], budget=budget, verdict=verdict(curve), rows=table_rows(curve), price=price)


def curve_files(curve: dict) -> dict[str, str]:
    """File name -> text of the curve files."""
    return {"curve.json": json.dumps(curve, indent=2) + "\n", "curve.md": curve_markdown(curve),
            "curve.svg": curve_svg(curve) + "\n"}
