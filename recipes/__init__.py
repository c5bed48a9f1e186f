"""Reference recipes written on top of the DSL: Kaczmarz and Kalman linear attention."""
