"""The self-contained HTML report: ``data.build_report_data`` (plain data, tested on its
own) and ``render.render`` (Jinja2 + the vendored chart library; needs the ``analysis``
extra). ``write.write_report`` ties them to a file for the CLI."""
