"""The calculator task as an OpenEnv environment (``openenv``'s own Environment, Action and
Observation classes, served by its ``create_app``): ``server/app.py`` is what groupflow starts
(``rollout.openenv.app: calc_openenv.server.app:app``), or what ``uvicorn`` serves by hand."""
