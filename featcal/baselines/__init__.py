"""Post-merge baselines FeatCal is compared against: Representation Surgery and ProbSurgery."""
