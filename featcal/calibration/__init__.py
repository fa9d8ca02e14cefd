"""Closed-form calibration: the ridge solve, moment sums, the forward-order walk and its drivers."""
