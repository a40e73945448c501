"""tierflow.commands: the verbs (`tierflow pack|inspect|verify|gc|cache|plan|bench|top|report|demo`),
thin over the library; the top of the import graph, imported by nothing below it."""
