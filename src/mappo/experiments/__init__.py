"""Many runs at once: sweeps of presets x overrides x seeds (serial or on Ray), learning-curve
plots with bootstrap bands, and report tables over the run directories they write."""
