"""Run records: the live `training_state.json`, the two SQLite stores, alerts and GPU telemetry.

The trainer talks to one facade, `apr.track.recorder.RunRecorder`. Readers (`apr runs`,
`apr experiment`, the monitor) use `apr.track.state`, `apr.track.runs` and `apr.track.experiment`.
Importing this package imports nothing heavy.
"""
