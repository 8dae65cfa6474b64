"""Test helpers shipped with kvhandoff: an independent oracle for the planner."""
