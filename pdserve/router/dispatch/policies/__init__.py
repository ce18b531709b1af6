"""The dispatcher's pure policies: placement, conditional disaggregation (threshold and
SLO), the planner's split, and the costs and demand they decide from. No I/O here."""
