"""`turnforge view`: a run (or two) as one offline HTML page, or served locally."""
