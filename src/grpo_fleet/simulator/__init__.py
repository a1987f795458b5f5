"""A fleet simulator: how many Macs a run can use, and when the learner needs more ranks.

It is a model, not a measurement. A discrete-event simulation replays the
fleet's own rules (capacity-sized leases, the in-flight cap, staleness
rejection, informative groups, weight fetches) over actors that generate at
a given speed and a learner whose step takes a given time at 1, 2 or 4
ranks. `make bench` (`fleet_sim`) checks it against real fleets run here.
At reasoning lengths each completion's length is drawn (`lengths`), an
actor's batch waits for its longest row or refills it (`decoding`), and the
step pays its real tokens and a share of its padding.
"""
