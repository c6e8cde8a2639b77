"""The memory planner and recipes: estimates against measurements, depth scaling, the measured table, the train
line."""
