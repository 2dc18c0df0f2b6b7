# cmake -DEXE=... -DNAME=... -DSUMMARY=... -DVERSION=... -DSEE_ALSO=... -DOUT=file.1.gz -P
# A manual page made from the program's own --help text (so it cannot drift
# from it), gzip -9n as Debian wants.
execute_process(COMMAND ${EXE} --help OUTPUT_VARIABLE out ERROR_VARIABLE err
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${EXE} --help exited ${rc}")
endif()
set(text "${out}${err}")
string(REPLACE "\\" "\\e" text "${text}")
string(REPLACE "-" "\\-" text "${text}")
# A line may not start with a roff control character.
string(REGEX REPLACE "(^|\n)([.'])" "\\1\\\\&\\2" text "${text}")
string(TOUPPER "${NAME}" upper)
file(WRITE ${OUT}.tmp ".TH ${upper} 1 \"\" \"weightd ${VERSION}\" \"User Commands\"
.SH NAME
${NAME} \\- ${SUMMARY}
.SH SYNOPSIS AND OPTIONS
This is the text of
.B ${NAME} \\-\\-help
.PP
.nf
${text}.fi
.SH SEE ALSO
${SEE_ALSO}
")
execute_process(COMMAND gzip -9nc ${OUT}.tmp OUTPUT_FILE ${OUT} COMMAND_ERROR_IS_FATAL ANY)
file(REMOVE ${OUT}.tmp)
