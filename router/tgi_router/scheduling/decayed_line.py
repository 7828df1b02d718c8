"""A line of the shards' step seconds over a step's size, fitted by least
squares over recent steps, older ones weighing less: what the step pacer
and the speculation policy learn step costs from. Pure Python."""


class DecayedLine:
    """y against x; each new point multiplies the weight of those before it by `decay`."""

    def __init__(self, decay: float):
        self.decay = decay
        # Decayed sums of 1, x, y, x*x and x*y.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        k = self.decay
        self._w, self._x, self._y = k * self._w + 1, k * self._x + x, k * self._y + y
        self._xx, self._xy = k * self._xx + x * x, k * self._xy + x * y

    def fit(self, min_var: float) -> tuple[float, float, float | None] | None:
        """(mean x, mean y, slope >= 0) of the points seen; the slope is None
        where x varied less than `min_var` (variance), so that it cannot be
        told; None before a point's worth of weight."""
        if self._w < 1.0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        slope = max(0.0, (self._xy / self._w - mx * my) / var) if var >= min_var else None
        return mx, my, slope
